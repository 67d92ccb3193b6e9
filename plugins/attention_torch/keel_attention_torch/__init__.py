"""keel plugin `attention-torch`: the reference paged-attention backend `torch_paged`.

Only the manifest lives here; discovery imports this module, so it must not import torch. The backend
itself (`keel_attention_torch.backend`) is imported when a profile or the selector picks it.
"""

from keel.plugins.manifest import PluginManifest

__version__ = "0.1.0"


def manifest() -> PluginManifest:
    """Entry point `attention-torch` in group `keel.plugins`; called by plugin discovery."""
    return PluginManifest(
        name="attention-torch",
        version=__version__,
        core_api=">=1.0,<2",
        provides={
            "attention_backend": {
                "torch_paged": "keel_attention_torch.backend:TorchPagedAttentionBackend",
                "torch_mla": "keel_attention_torch.mla:TorchMLABackend",
            }
        },
        description="Reference paged attention in plain torch: any device, fp32/fp16/bf16, GQA, sliding window.",
    )
