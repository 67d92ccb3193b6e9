"""keel plugin `attention-flash`: Triton paged attention backends `triton_flash` and `triton_mla` (MLA).

Only the manifest lives here; discovery imports this module, so it must not import torch or triton.
"""

from keel.plugins.manifest import PluginManifest

__version__ = "0.1.0"


def manifest() -> PluginManifest:
    """Entry point `attention-flash` in group `keel.plugins`; called by plugin discovery."""
    return PluginManifest(
        name="attention-flash",
        version=__version__,
        core_api=">=1.0,<2",
        provides={"attention_backend": {
            "triton_flash": "keel_attention_flash.backend:TritonFlashAttentionBackend",
            "triton_mla": "keel_attention_flash.mla_backend:TritonMLABackend",
        }},
        description="Triton paged FlashAttention (varlen prefill/decode, GQA/MQA, split-K decode) and MLA.",
    )
