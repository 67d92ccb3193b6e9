"""keel-models-deepseek: DeepSeek-V2 and DeepSeek-V3 for keel.

This module is the plugin's entry point and is imported at discovery: it must import nothing heavy
(no torch); model classes are referenced lazily as "module:attr" strings. MLA layers ask for an
MLA-capable attention backend by KV cache kind ("mla_latent"): `torch_mla` from attention-torch on any
platform, or any other backend registered with `supports_mla=True`.
"""

from keel.plugins.manifest import PluginManifest

__version__ = "0.1.0"


def manifest() -> PluginManifest:
    """Entry point `models-deepseek` in group `keel.plugins`; called by plugin discovery."""
    return PluginManifest(
        name="models-deepseek",
        version=__version__,
        core_api=">=1.0,<2",
        provides={
            "model_arch": {
                "DeepseekV2ForCausalLM": "keel_models_deepseek.deepseek_v2:DeepseekV2ForCausalLM",
                "DeepseekV3ForCausalLM": "keel_models_deepseek.deepseek_v3:DeepseekV3ForCausalLM",
            },
            "spec_decoder": {"mtp": "keel_models_deepseek.mtp:DeepSeekMTPProposer"},
        },
        description="DeepSeek-V2/V3: multi-head latent attention (latent KV cache), routed MoE, MTP drafts",
    )
