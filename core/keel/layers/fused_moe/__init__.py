"""Mixture-of-experts building blocks: routing, the stacked expert layer and its torch reference path.

Fused kernels (routing, alignment, grouped GEMMs) are `custom_op` plugins bound into `FusedMoE` by the
worker (ops `select_experts` and `fused_experts`, see `keel.layers.custom_op`); kernels-triton provides
them for CUDA.
"""

from keel.layers.fused_moe.align import moe_align_block_size_torch
from keel.layers.fused_moe.layer import FusedMoE
from keel.layers.fused_moe.parallel import FusedMoEParallelConfig
from keel.layers.fused_moe.router import (
    RoutingConfig,
    RoutingConfigError,
    fused_topk,
    grouped_topk,
    select_experts,
)
from keel.layers.fused_moe.torch_ref import fused_experts_torch

__all__ = [
    "FusedMoE",
    "FusedMoEParallelConfig",
    "RoutingConfig",
    "RoutingConfigError",
    "fused_experts_torch",
    "fused_topk",
    "grouped_topk",
    "moe_align_block_size_torch",
    "select_experts",
]
