"""Typed registries: per kind, an open string key -> a lazy "module:attr" reference and its provider.

Built by the loader from the manifests of the loaded plugins. `get` imports the reference the first
time a component is selected; an import failure is a `PluginLoadError` naming the providing plugin.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from keel.plugins.errors import DuplicateKeyError, PluginLoadError, UnknownKeyError


@dataclass(frozen=True)
class Provider:
    """Who provides a registry entry: the plugin (entry-point name) and its distribution."""

    plugin: str
    distribution: str | None

    def __str__(self) -> str:
        return f"plugin {self.plugin!r} ({self.distribution or 'unknown distribution'})"


def import_ref(ref: str) -> Any:
    """Import `"package.module:attr.sub"` and return the attribute."""
    module_name, _, attr_path = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


class Registry:
    """The entries of one kind. Called by selectors (platform, attention backend, model, ...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._refs: dict[str, str] = {}
        self._providers: dict[str, Provider] = {}
        self._loaded: dict[str, Any] = {}

    def add(self, key: str, ref: str, provider: Provider) -> None:
        """Called by the loader while building the plugin set; a duplicate key raises."""
        if key in self._refs:
            raise DuplicateKeyError(self.kind, key, str(self._providers[key]), str(provider))
        self._refs[key] = ref
        self._providers[key] = provider

    def keys(self) -> list[str]:
        """Registered keys, in the order their plugins were loaded."""
        return list(self._refs)

    def __contains__(self, key: object) -> bool:
        return key in self._refs

    def __iter__(self) -> Iterator[str]:
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)

    def _check(self, key: str) -> None:
        if key not in self._refs:
            raise UnknownKeyError(self.kind, key, self._refs)

    def ref(self, key: str) -> str:
        """The lazy reference, without importing it."""
        self._check(key)
        return self._refs[key]

    def provider(self, key: str) -> Provider:
        self._check(key)
        return self._providers[key]

    def get(self, key: str) -> Any:
        """Import (once) and return the component registered under `key`."""
        self._check(key)
        if key not in self._loaded:
            provider = self._providers[key]
            try:
                self._loaded[key] = import_ref(self._refs[key])
            except Exception as exc:
                cause = f"importing {self.kind} {key!r} from {self._refs[key]!r}: {type(exc).__name__}: {exc}"
                raise PluginLoadError(provider.plugin, provider.distribution, cause) from exc
        return self._loaded[key]

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, keys={self.keys()})"
