"""keel plugin `reasoning-parsers`: `reasoning_parser` "deepseek_r1" and "qwen3".

Only the manifest lives here; discovery imports this module.
"""

from keel.plugins.manifest import PluginManifest

__version__ = "0.1.0"
_THINK = "keel_reasoning_parsers.think"


def manifest() -> PluginManifest:
    """Entry point `reasoning-parsers` in group `keel.plugins`; called by plugin discovery."""
    return PluginManifest(
        name="reasoning-parsers",
        version=__version__,
        core_api=">=1.0,<2",
        provides={"reasoning_parser": {"deepseek_r1": f"{_THINK}:DeepSeekR1ReasoningParser",
                                       "qwen3": f"{_THINK}:Qwen3ReasoningParser"}},
        description="<think>...</think> reasoning parsers: DeepSeek-R1 and Qwen3 conventions.",
    )
