"""Lifecycle hooks plugins may implement (pluggy). Only lifecycle events: components go in registries.

A plugin lists objects carrying `@hookimpl` functions in its manifest's `hooks` ("module:attr"); the
loader registers them on the plugin set's `PluginManager`. Every hook is optional for a plugin. All
arguments are passed by keyword, so a hook implementation may accept a subset of them.
"""

from __future__ import annotations

import argparse
from typing import Any

import pluggy

PROJECT = "keel"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class KeelHookSpecs:
    @hookspec
    def keel_add_cli_options(self, parser: argparse.ArgumentParser, command: str) -> None:
        """Called by `keel.cli` while building the parser of an engine command (`command` is its name).

        Add options under a plugin-specific prefix; they reach `keel_adjust_config` through
        `EngineConfig.cli_extras`. Called once per process, before arguments are parsed.
        """

    @hookspec
    def keel_adjust_config(self, config: Any) -> dict[str, Any] | None:
        """Called by `EngineArgs.create_engine_config` after the platform's own adjustment.

        Returns a patch `{section: {field: value}}` (or None); it is applied, never an in-place edit,
        and the patched config is validated again. Patches apply in plugin load order.
        """

    @hookspec
    def keel_engine_start(self, config: Any) -> None:
        """Called once by the engine core after the workers are ready, before the first step."""

    @hookspec
    def keel_worker_init(self, config: Any, rank: int) -> None:
        """Called in every worker process after its device is set, before the model is built."""

    @hookspec
    def keel_request_finished(self, request_id: str, reason: str) -> None:
        """Called by the engine core when a request stops (`reason`: stop, length, abort, ...).

        Runs on the engine loop: keep it fast and never raise.
        """

    @hookspec
    def keel_shutdown(self) -> None:
        """Called once when the engine shuts down (also after a failure); must be idempotent."""


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(KeelHookSpecs)
    return pm
