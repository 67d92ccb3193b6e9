"""The MoE `custom_op` providers of kernels-triton: `router_gemm`, `select_experts` and `fused_experts`.

Registered by the `kernels-triton` manifest; the worker instantiates each class once and binds the
instance into every `FusedMoE` layer (contracts in `keel.layers.custom_op`). Compiled on CUDA, interpreted
on the CPU under `TRITON_INTERPRET=1` (tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from keel.layers.fused_moe.quant_config import FusedMoEQuantConfig
from keel.layers.fused_moe.router import RoutingConfig
from keel_kernels_triton.fused_moe.grouped_gemm import fused_experts_triton
from keel_kernels_triton.fused_moe.quant_gemm import fused_experts_quant_triton, quant_kernel_supports
from keel_kernels_triton.fused_moe.router_gemm import SMALL_T, router_gemm_triton
from keel_kernels_triton.fused_moe.routing import routing_triton_supported, select_experts_triton
from keel_kernels_triton.support import TritonOp


# Past them, cuBLAS on a float32 copy for 16- and 32-bit floats: on the H200 (DeepSeek-V2-Lite, 64 experts x
# 2048) the kernel's IEEE-float32 tl.dot tiles took 46 us per layer at 256 tokens and 215 us at 8192, the copy
# plus cuBLAS's float32 GEMM 13 us and 117 us; at one token the kernel's reduction path took 2.3 us against
# 4.6. bf16 activations take the kernel at every size: its split-weight tensor-core path (router_gemm.py)
# took 38.5 against 112.8 us at 8192 tokens on an H100 SXM at e3a41fb (h100-router-gemm-e3a41fb.json), but a
# flat 25-42 us up to 1024 tokens (10-25 for the reference) until it split K across programs: then 5.2-8.9 us
# up to 1024 tokens and 40.3 at 8192 (h100-router-gemm-splitk-f183f15.json).
ROUTER_KERNEL_MAX_TOKENS = SMALL_T


class TritonRouterGemm(TritonOp):
    """`router_gemm(x, weight) -> logits`: float32 router logits from 16-bit activations without a float32
    copy of them: bf16 at every size, other dtypes up to ROUTER_KERNEL_MAX_TOKENS tokens (the reference
    computation past it: the faster one there). Declines gates whose weight is not float32."""

    def supports_layer(self, layer: torch.nn.Module) -> bool:
        weight = getattr(layer, "weight", None)
        return isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and weight.dim() == 2

    def __call__(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        weight: torch.Tensor,  # [num_experts, hidden] float32
    ) -> torch.Tensor:  # [num_tokens, num_experts] float32
        if x.dtype == torch.bfloat16 or x.shape[0] <= ROUTER_KERNEL_MAX_TOKENS:  # static per graph bucket
            return router_gemm_triton(x, weight)
        return F.linear(x.float(), weight)


class TritonSelectExperts(TritonOp):
    """`select_experts(router_logits, routing, e_score_correction_bias) -> (weights, ids)` in one launch.

    Declines (at bind time) layers whose routing the kernel does not implement; they keep torch routing.
    """

    def supports_layer(self, layer: torch.nn.Module) -> bool:
        routing = getattr(layer, "routing", None)
        return isinstance(routing, RoutingConfig) and routing_triton_supported(routing)

    def __call__(
        self,
        router_logits: torch.Tensor,  # [num_tokens, num_experts]
        routing: RoutingConfig,
        e_score_correction_bias: torch.Tensor | None,  # [num_experts]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # weights, ids [num_tokens, routing.num_routes] float32 / int32
        return select_experts_triton(router_logits, routing, e_score_correction_bias)


class TritonFusedExperts(TritonOp):
    """`fused_experts(hidden, w13, w2, topk_weights, topk_ids, activation, residual[, quant]) -> out`:
    alignment, both grouped GEMMs (activation in the second one's operand load) and the combine; quantized
    experts (block FP8, int4) through the dequantizing GEMMs of quant_gemm.py. Declines (at bind time)
    layers whose quantized experts it does not implement; their method's reference path serves them."""

    def supports_layer(self, layer: torch.nn.Module) -> bool:
        method = getattr(layer, "quant_method", None)
        return method is None or quant_kernel_supports(method.get_fused_moe_quant_config(layer))

    def __call__(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden_size]
        w2: torch.Tensor,  # [num_experts, hidden_size, intermediate]
        topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
        topk_ids: torch.Tensor,  # [num_tokens, top_k] int
        activation: str,
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]
        quant: FusedMoEQuantConfig | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        if quant is not None:
            return fused_experts_quant_triton(hidden, w13, w2, topk_weights, topk_ids, activation, residual, quant)
        return fused_experts_triton(hidden, w13, w2, topk_weights, topk_ids, activation, residual)
