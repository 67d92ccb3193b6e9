"""Mixture-of-experts building blocks: routing, the stacked expert layer, torch and Triton paths."""

from keel.layers.fused_moe.layer import MOE_BACKENDS, FusedMoE
from keel.layers.fused_moe.router import (
    RoutingConfig,
    RoutingConfigError,
    fused_topk,
    grouped_topk,
    select_experts,
)
from keel.layers.fused_moe.torch_ref import fused_experts_torch
from keel.layers.fused_moe.triton_moe import fused_experts_triton, moe_align_block_size, triton_available

__all__ = [
    "MOE_BACKENDS",
    "FusedMoE",
    "RoutingConfig",
    "RoutingConfigError",
    "fused_experts_torch",
    "fused_experts_triton",
    "fused_topk",
    "grouped_topk",
    "moe_align_block_size",
    "select_experts",
    "triton_available",
]
