"""keel plugin `tool-parsers`: `tool_parser` entries for the common tool-call formats.

Only the manifest lives here; discovery imports this module.
"""

from keel.plugins.manifest import PluginManifest

__version__ = "0.1.0"
_P = "keel_tool_parsers.parsers"


def manifest() -> PluginManifest:
    """Entry point `tool-parsers` in group `keel.plugins`; called by plugin discovery."""
    return PluginManifest(
        name="tool-parsers",
        version=__version__,
        core_api=">=1.0,<2",
        provides={"tool_parser": {"hermes": f"{_P}:HermesToolParser", "qwen3": f"{_P}:Qwen3ToolParser",
                                  "llama3_json": f"{_P}:Llama3JsonToolParser", "mistral": f"{_P}:MistralToolParser",
                                  "deepseek_v3": f"{_P}:DeepSeekV3ToolParser"}},
        description="Tool-call parsers: hermes / qwen3 (<tool_call>), llama3_json, mistral ([TOOL_CALLS]), "
                    "deepseek_v3.",
    )
