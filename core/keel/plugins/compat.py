"""Core API compatibility: does a plugin's declared `core_api` range admit this core?"""

from __future__ import annotations

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from keel.version import CORE_API_VERSION


def core_api_problem(core_api: str, core_version: str = CORE_API_VERSION) -> str | None:
    """None when `core_api` admits `core_version`; otherwise the reason, for the load error."""
    try:
        spec = SpecifierSet(core_api)
    except InvalidSpecifier:
        return f"invalid core_api range {core_api!r} in its manifest (expected e.g. '>=1.0,<2')"
    if not spec.contains(Version(core_version), prereleases=True):
        return f"incompatible core API: plugin supports {core_api!r}, this keel offers {core_version}"
    return None
