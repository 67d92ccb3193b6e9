"""Typed errors of the plugin system. Each message names what to fix.

`PluginLoadError` is the one startup failure the CLI turns into a non-zero exit: it always names the
plugin, its distribution and the cause (the original exception text).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def suggest(word: str, candidates: Iterable[str]) -> str:
    """" (did you mean 'x'?)" for the nearest candidate, or "" when nothing is close."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class PluginError(Exception):
    """Base of every plugin-system error."""


class PluginLoadError(PluginError):
    """A plugin could not be used: not installed, failed to import or load, or incompatible core API."""

    def __init__(self, plugin: str, distribution: str | None, cause: str) -> None:
        self.plugin = plugin
        self.distribution = distribution
        self.cause = cause
        dist = distribution if distribution else "<not installed>"
        super().__init__(f"plugin {plugin!r} (distribution {dist}) failed to load: {cause}")


class DuplicateKeyError(PluginError):
    """Two loaded plugins provide the same key in one registry kind."""

    def __init__(self, kind: str, key: str, first: str, second: str) -> None:
        self.kind, self.key, self.first, self.second = kind, key, first, second
        super().__init__(
            f"duplicate {kind} key {key!r}: provided by {first} and by {second}; "
            "name only one of them in the profile's `plugins:` list"
        )


class UnknownKeyError(PluginError, KeyError):
    """A registry lookup for a key no loaded plugin provides."""

    def __init__(self, kind: str, key: str, available: Iterable[str]) -> None:
        self.kind, self.key = kind, key
        self.available = sorted(available)
        listing = ", ".join(self.available) if self.available else "none"
        self.message = (
            f"no {kind} named {key!r}{suggest(key, self.available)}; available: {listing}. "
            "Is the plugin providing it installed and listed in the profile's `plugins:`?"
        )
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message
