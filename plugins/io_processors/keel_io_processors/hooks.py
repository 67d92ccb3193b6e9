"""The io-processors plugin's CLI options (`keel serve`): which `reasoning_parser` the chat processor
and `tool_parser` uses. They reach the processors through `EngineConfig.plugin_options` (the server passes it)."""

from __future__ import annotations

from keel.plugins.hookspecs import hookimpl


class Hooks:
    @hookimpl
    def keel_add_cli_options(self, parser, command):
        if command != "serve":
            return
        group = parser.add_argument_group("chat output parsing (io-processors)")
        group.add_argument("--reasoning-parser", default=None,
                           help="a reasoning_parser registry key (e.g. deepseek_r1, qwen3): chat answers get "
                                "reasoning_content split from content (default: none)")
        group.add_argument("--tool-call-parser", default=None,
                           help="a tool_parser registry key (hermes, qwen3, llama3_json, mistral, deepseek_v3): "
                                'enables tool_choice "auto" (default: none)')


hooks = Hooks()
