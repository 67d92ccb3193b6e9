"""keel plugin `kernels-triton`: fused Triton kernels registered under the `custom_op` kind -- the
elementwise ops of norms, rope and activations, the fused MoE (router logits, routing, alignment, grouped GEMMs) and the
structured-output token bitmask.

Only the manifest lives here; discovery imports this module, so it must not import torch or triton.
"""

from keel.plugins.manifest import PluginManifest

__version__ = "0.1.0"

_OPS = "keel_kernels_triton.ops"
_MOE_OPS = "keel_kernels_triton.fused_moe.ops"


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
                "mla_rope": f"{_OPS}:TritonMLARope",
                "mla_rope_norm": f"{_OPS}:TritonMLARopeNorm",
                "silu_and_mul": f"{_OPS}:TritonSiluAndMul",
                "linear_small_m": f"{_OPS}:TritonLinearSmallM",
                "router_gemm": f"{_MOE_OPS}:TritonRouterGemm",
                "select_experts": f"{_MOE_OPS}:TritonSelectExperts",
                "fused_experts": f"{_MOE_OPS}:TritonFusedExperts",
                "apply_token_bitmask": "keel_kernels_triton.token_bitmask:TritonApplyTokenBitmask",
            }
        },
        description="Fused Triton kernels: residual add + RMSNorm, RMSNorm, neox rope, MLA's q/k rope (with the "
                    "latent's RMSNorm), SiluAndMul; unquantized linear layers at decode sizes where measured faster "
                    "(GEMV); MoE router logits, routing and fused experts (grouped GEMMs with tuned tiles); the "
                    "structured-output token bitmask.",
    )
