"""Find every plugin installed in the `keel.plugins` entry-point group and read its manifest.

Discovery imports only each plugin's manifest module (which by contract imports nothing heavy); it
never raises for a broken plugin: the failure is recorded on the `DiscoveredPlugin` so that
`keel plugins list` can show it and the loader can decide whether it is fatal.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from keel.plugins.compat import core_api_problem
from keel.plugins.manifest import KINDS, PluginManifest

logger = logging.getLogger("keel.plugins")

GROUP = "keel.plugins"
CORE_PLUGIN = "core"
CORE_DISTRIBUTION = "keel"


@dataclass(frozen=True)
class DiscoveredPlugin:
    """One entry point of the group. `error` is None when its manifest loaded and is compatible."""

    name: str  # entry-point name, e.g. "platform-cpu"
    distribution: str | None  # distribution name, e.g. "keel-platform-cpu"
    dist_version: str | None
    value: str  # the entry point's "module:attr"
    manifest: PluginManifest | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def version(self) -> str | None:
        return self.manifest.version if self.manifest is not None else self.dist_version

    @property
    def label(self) -> str:
        """How errors name this plugin: `'name' (distribution)`."""
        return f"{self.name!r} ({self.distribution or 'unknown distribution'})"


def _call_manifest(obj: object) -> PluginManifest:
    manifest = obj() if callable(obj) and not isinstance(obj, PluginManifest) else obj
    if not isinstance(manifest, PluginManifest):
        raise TypeError(f"entry point must yield a PluginManifest, got {type(manifest).__name__}")
    return manifest


def manifest_problem(name: str, manifest: PluginManifest) -> str | None:
    """Structural problems of a manifest that make it unusable, or None."""
    if manifest.name != name:
        return f"manifest name {manifest.name!r} differs from its entry-point name {name!r}"
    for kind, keys in manifest.provides.items():
        if kind not in KINDS:
            from keel.plugins.errors import suggest

            return f"provides unknown kind {kind!r}{suggest(kind, KINDS)}; known kinds: {', '.join(KINDS)}"
        for key, ref in keys.items():
            if not isinstance(ref, str) or ref.count(":") != 1 or not all(ref.split(":")):
                return f"{kind} {key!r} has malformed reference {ref!r} (expected 'package.module:attr')"
    for ref in manifest.hooks:
        if not isinstance(ref, str) or ref.count(":") != 1:
            return f"hook reference {ref!r} is malformed (expected 'package.module:attr')"
    return core_api_problem(manifest.core_api)


def read_entry_point(ep: md.EntryPoint, load: Callable[[], object] | None = None) -> DiscoveredPlugin:
    """Turn one entry point into a DiscoveredPlugin, catching every failure of its manifest."""
    dist = getattr(ep, "dist", None)
    dist_name = dist.metadata["Name"] if dist is not None else None
    dist_version = dist.version if dist is not None else None
    base = {"name": ep.name, "distribution": dist_name, "dist_version": dist_version, "value": ep.value}
    try:
        manifest = _call_manifest((load or ep.load)())
    except Exception as exc:  # noqa: BLE001 -- a broken plugin must never break discovery
        return DiscoveredPlugin(**base, error=f"{type(exc).__name__}: {exc}")
    problem = manifest_problem(ep.name, manifest)
    return DiscoveredPlugin(**base, manifest=manifest, error=problem)


def _builtin_core() -> DiscoveredPlugin:
    """The core plugin when keel runs from a source tree without installed metadata."""
    from keel import builtin
    from keel.version import __version__

    manifest = builtin.manifest()
    return DiscoveredPlugin(
        name=CORE_PLUGIN,
        distribution=CORE_DISTRIBUTION,
        dist_version=__version__,
        value="keel.builtin:manifest",
        manifest=manifest,
        error=manifest_problem(CORE_PLUGIN, manifest),
    )


def _entry_points(path: list[str] | None) -> list[md.EntryPoint]:
    if path is None:
        return list(md.entry_points(group=GROUP))
    eps: list[md.EntryPoint] = []
    seen: set[str] = set()
    for dist in md.distributions(path=path):
        norm = dist.metadata["Name"].lower().replace("_", "-")
        if norm in seen:  # first on the path wins, like importlib.metadata.entry_points()
            continue
        seen.add(norm)
        eps.extend(ep for ep in dist.entry_points if ep.group == GROUP)
    return eps


def discover(path: list[str] | None = None) -> list[DiscoveredPlugin]:
    """Every plugin of the `keel.plugins` group, sorted by name; the core plugin is always present.

    `path` restricts the search to those directories (tests, isolated environments); None searches
    `sys.path`. Two distributions using one entry-point name are both returned, both with an error.
    """
    found = [read_entry_point(ep) for ep in _entry_points(path)]
    if not any(p.name == CORE_PLUGIN for p in found):
        found.append(_builtin_core())
    by_name: dict[str, list[DiscoveredPlugin]] = {}
    for plugin in found:
        by_name.setdefault(plugin.name, []).append(plugin)
    result: list[DiscoveredPlugin] = []
    for name, same in sorted(by_name.items()):
        if len(same) > 1:
            dists = " and ".join(str(p.distribution) for p in same)
            same = [replace(p, error=f"entry-point name {name!r} is claimed by {dists}") for p in same]
        result.extend(same)
    for plugin in result:
        if not plugin.ok:
            logger.debug("plugin %s is broken: %s", plugin.label, plugin.error)
    return result
