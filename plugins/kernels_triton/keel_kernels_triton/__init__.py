"""keel plugin `kernels-triton`: fused Triton kernels registered under the `custom_op` kind.

Only the manifest lives here; discovery imports this module, so it must not import torch or triton.
"""

from keel.plugins.manifest import PluginManifest

__version__ = "0.1.0"

_OPS = "keel_kernels_triton.ops"


def manifest() -> PluginManifest:
    """Entry point `kernels-triton` in group `keel.plugins`; called by plugin discovery."""
    return PluginManifest(
        name="kernels-triton",
        version=__version__,
        core_api=">=1.0,<2",
        provides={
            "custom_op": {
                "fused_add_rms_norm": f"{_OPS}:TritonFusedAddRMSNorm",
                "rms_norm": f"{_OPS}:TritonRMSNorm",
                "rotary_embedding": f"{_OPS}:TritonRotaryEmbedding",
                "silu_and_mul": f"{_OPS}:TritonSiluAndMul",
            }
        },
        description="Fused Triton elementwise kernels: residual add + RMSNorm, RMSNorm, neox rope, SiluAndMul.",
    )
