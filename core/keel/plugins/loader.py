"""Load a plugin set: the plugins a profile names (strict) or every discovered one (`auto`).

Strict: a named plugin that is not installed, fails to import, or declares an incompatible core API
raises `PluginLoadError` -- startup stops, nothing falls back. `auto`: such a plugin is logged as a
warning naming it and skipped, since nobody asked for it. The `core` plugin is always loaded first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import pluggy

from keel.plugins.discovery import CORE_PLUGIN, DiscoveredPlugin, discover
from keel.plugins.errors import PluginLoadError, suggest
from keel.plugins.hookspecs import new_plugin_manager
from keel.plugins.manifest import KINDS
from keel.plugins.registry import Provider, Registry, import_ref

logger = logging.getLogger("keel.plugins")


@dataclass
class PluginSet:
    """The loaded plugins of one process, their registries and the lifecycle hook manager.

    Workers get the same set by loading `names` again (they travel with the config).
    """

    plugins: list[DiscoveredPlugin]
    registries: dict[str, Registry]
    hooks: pluggy.PluginManager
    auto: bool = False
    skipped: list[DiscoveredPlugin] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.plugins]

    def registry(self, kind: str) -> Registry:
        """The registry of `kind` (one of `keel.plugins.manifest.KINDS`), possibly empty."""
        if kind not in self.registries:
            hint = suggest(kind, KINDS)
            raise ValueError(f"unknown registry kind {kind!r}{hint}; kinds: {', '.join(KINDS)}")
        return self.registries[kind]

    def get(self, name: str) -> DiscoveredPlugin:
        for plugin in self.plugins:
            if plugin.name == name:
                return plugin
        raise KeyError(f"plugin {name!r} is not loaded; loaded: {', '.join(self.names)}")


def _register_hooks(pm: pluggy.PluginManager, plugin: DiscoveredPlugin) -> None:
    assert plugin.manifest is not None
    for ref in plugin.manifest.hooks:
        try:
            pm.register(import_ref(ref), name=f"{plugin.name}:{ref}")
        except Exception as exc:
            cause = f"loading hooks {ref!r}: {type(exc).__name__}: {exc}"
            raise PluginLoadError(plugin.name, plugin.distribution, cause) from exc


def _select(
    names: Sequence[str] | Literal["auto"], discovered: list[DiscoveredPlugin]
) -> tuple[list[DiscoveredPlugin], bool]:
    if names == "auto":
        return list(discovered), True
    if isinstance(names, str):
        raise TypeError(f"plugins must be a list of entry-point names or 'auto', got {names!r}")
    wanted = [CORE_PLUGIN] + [n for n in dict.fromkeys(names) if n != CORE_PLUGIN]
    chosen: list[DiscoveredPlugin] = []
    installed = sorted({p.name for p in discovered})
    for name in wanted:
        matches = [p for p in discovered if p.name == name]
        if not matches:
            cause = (
                f"not installed: no entry point {name!r} in group 'keel.plugins'{suggest(name, installed)}; "
                f"installed plugins: {', '.join(installed)}"
            )
            raise PluginLoadError(name, None, cause)
        chosen.extend(matches)  # several matches carry a name-clash error, raised below
    return chosen, False


def load_plugins(names: Sequence[str] | Literal["auto"], *, path: list[str] | None = None) -> PluginSet:
    """Load the named plugins (plus `core`), or every discovered one for `"auto"`.

    Called once per process at startup (engine, worker, CLI). Raises `PluginLoadError` for a named
    plugin that cannot be used and `DuplicateKeyError` when two loaded plugins provide one key.
    `path` restricts discovery to those directories (see `discover`).
    """
    chosen, auto = _select(names, discover(path))
    pm = new_plugin_manager()
    registries = {kind: Registry(kind) for kind in KINDS}
    loaded: list[DiscoveredPlugin] = []
    skipped: list[DiscoveredPlugin] = []
    for plugin in chosen:
        try:
            if plugin.error is not None:
                raise PluginLoadError(plugin.name, plugin.distribution, plugin.error)
            _register_hooks(pm, plugin)
        except PluginLoadError as exc:
            if not auto or plugin.name == CORE_PLUGIN:
                raise
            logger.warning("skipping plugin %s: %s", plugin.label, exc.cause)
            skipped.append(plugin)
            continue
        loaded.append(plugin)
    for plugin in loaded:
        assert plugin.manifest is not None
        provider = Provider(plugin.name, plugin.distribution)
        for kind, keys in plugin.manifest.provides.items():
            for key, ref in keys.items():
                registries[kind].add(key, ref, provider)
    logger.debug("loaded plugins: %s", ", ".join(p.name for p in loaded))
    return PluginSet(plugins=loaded, registries=registries, hooks=pm, auto=auto, skipped=skipped)
