"""YAML profiles: which plugins, platform and attention backend to use, and engine settings.

A profile file (profiles/<name>.yaml) has the top-level keys below; `engine:` holds `EngineArgs`
field names. Unknown keys are errors naming the key and the nearest valid one. With no profile the
built-in default applies: every discovered plugin, platform and attention backend auto-detected.

    description: CPU reference profile
    plugins: [platform-cpu, attention-torch, models-llama]   # or: auto
    platform: cpu                                            # or: auto
    attention_backend: auto
    engine: {block_size: 16, max_num_seqs: 64}
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from keel.plugins.errors import suggest

TOP_LEVEL_KEYS = ("description", "plugins", "platform", "attention_backend", "engine")
# Engine settings that are profile top-level keys rather than `engine:` entries.
_TOP_LEVEL_ARGS = ("plugins", "platform", "attention_backend", "profile")
PROFILE_PATH_ENV = "KEEL_PROFILE_PATH"


class ProfileError(ValueError):
    """A profile that cannot be found or is invalid; the message names the file and the key."""


@dataclass(frozen=True)
class Profile:
    name: str
    path: str | None = None
    plugins: tuple[str, ...] | Literal["auto"] = "auto"
    platform: str = "auto"
    attention_backend: str = "auto"
    engine: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", MappingProxyType(dict(self.engine)))


DEFAULT_PROFILE = Profile(name="<built-in default>", description="every discovered plugin, auto-detected")


def profile_dirs() -> list[Path]:
    """Where profile names are looked up: $KEEL_PROFILE_PATH entries, ./profiles, the source tree's."""
    dirs = [Path(p) for p in os.environ.get(PROFILE_PATH_ENV, "").split(os.pathsep) if p]
    dirs.append(Path.cwd() / "profiles")
    dirs.append(Path(__file__).resolve().parents[2] / "profiles")  # repo root when run from source
    return dirs


def find_profile(name_or_path: str) -> Path:
    """A path to an existing file, or `<name>.yaml` in `profile_dirs()`."""
    direct = Path(name_or_path)
    if direct.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if direct.is_file():
            return direct
        raise ProfileError(f"profile file {name_or_path!r} does not exist")
    known: set[str] = set()
    for d in profile_dirs():
        candidate = d / f"{name_or_path}.yaml"
        if candidate.is_file():
            return candidate
        if d.is_dir():
            known.update(p.stem for p in d.glob("*.yaml"))
    listing = ", ".join(sorted(known)) or "none"
    raise ProfileError(
        f"no profile named {name_or_path!r}{suggest(name_or_path, known)}; known profiles: {listing} "
        f"(searched ${PROFILE_PATH_ENV}, ./profiles and the keel source tree; a path to a .yaml works too)"
    )


def _check_name(where: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ProfileError(f"{where}: {key!r} must be a non-empty string, got {value!r}")
    return value


def parse_profile(data: Any, name: str, path: str | None = None) -> Profile:
    """Validate a loaded YAML mapping. Engine values are type-checked against `EngineArgs`."""
    from keel.config import EngineArgs

    where = f"profile {name!r}" + (f" ({path})" if path else "")
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ProfileError(f"{where}: expected a mapping at the top level, got {type(data).__name__}")
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise ProfileError(
                f"{where}: unknown key {key!r}{suggest(str(key), TOP_LEVEL_KEYS)}; "
                f"valid keys: {', '.join(TOP_LEVEL_KEYS)}"
            )
    plugins = data.get("plugins", "auto")
    if plugins != "auto":
        if not isinstance(plugins, list) or not all(isinstance(p, str) and p for p in plugins):
            raise ProfileError(
                f"{where}: 'plugins' must be 'auto' or a list of entry-point names, got {plugins!r}"
            )
        plugins = tuple(plugins)
    engine = data.get("engine") or {}
    if not isinstance(engine, Mapping):
        raise ProfileError(f"{where}: 'engine' must be a mapping of engine settings, got {engine!r}")
    valid = [f for f in EngineArgs.field_names() if f not in _TOP_LEVEL_ARGS]
    for key, value in engine.items():
        if key in _TOP_LEVEL_ARGS:
            raise ProfileError(f"{where}: {key!r} is a top-level profile key, not an `engine:` setting")
        if key not in valid:
            raise ProfileError(f"{where}: unknown engine key {key!r}{suggest(str(key), valid)}")
        problem = EngineArgs.check_type(key, value)
        if problem:
            raise ProfileError(f"{where}: engine.{key}: {problem}")
    description = data.get("description", "")
    return Profile(
        name=name,
        path=path,
        plugins=plugins,
        platform=_check_name(where, "platform", data.get("platform", "auto")),
        attention_backend=_check_name(where, "attention_backend", data.get("attention_backend", "auto")),
        engine=engine,
        description=str(description),
    )


def load_profile(name_or_path: str) -> Profile:
    """Find, read and validate a profile (called by `EngineArgs.create_engine_config`)."""
    import yaml

    path = find_profile(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ProfileError(f"profile {str(path)!r} is not valid YAML: {exc}") from exc
    return parse_profile(data, name=path.stem, path=str(path))
