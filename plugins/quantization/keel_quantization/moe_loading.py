"""Weight loaders for quantized routed experts, on the FusedMoE layer's own geometry.

A checkpoint ships one tensor per expert and projection (`experts.{e}.gate_proj.weight_scale_inv`, ...);
the model's expert mapping routes it to the stacked parameter (`experts.w13_weight_scale_inv`) with shard
id (expert, "w1" | "w2" | "w3"). Like `loading.py` for linear layers, a quantized tensor runs along the
projection's outputs and inputs in units (128-row scale blocks, 8 packed 4-bit values, input groups):
gate (w1) and up (w3) fill the first and second half of w13's outputs, each cut to this rank's slice of
the intermediate size; down (w2) keeps every output and this rank's slice of its intermediate inputs.
Another expert-parallel rank's expert is consumed without a copy. Mismatches raise `WeightLoadError`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from keel.models.weights import WeightLoadError, check_shape, set_weight_attrs
from keel_quantization.loading import narrow_rank

_CKPT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def expert_name(layer: Any, shard_id: Any) -> str:
    return f"{layer.prefix or 'FusedMoE'}.{shard_id[0]}.{_CKPT[shard_id[1]]}"


def load_expert(
    layer: Any,
    param: torch.Tensor,
    loaded: torch.Tensor,
    shard_id: Any = None,
    *,
    out_dim: int | None,
    in_dim: int | None,
    out_unit: int = 1,
    in_unit: int = 1,
    dtype: torch.dtype | None = None,
    per_shard: bool = False,
) -> None:
    """Copy this rank's part of one expert's checkpoint tensor into `param` [local experts, ...].

    `out_dim` / `in_dim`: the tensor's dimension along the projection's outputs / inputs (None: none);
    `per_shard`: `param` holds one row per projection ([E, 2, ...] for w13, [E, 1, ...] for w2: GPTQ's
    g_idx), the tensor runs along the inputs only. `dtype`: the only dtype the checkpoint tensor may have.
    """
    ok = isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in _CKPT
    if not ok or not 0 <= shard_id[0] < layer.num_experts:
        raise WeightLoadError(f"{layer.prefix}: expert tensors need a shard id (expert, 'w1'|'w2'|'w3'), "
                              f"got {shard_id!r}")
    expert, shard = shard_id
    local = expert - layer.expert_start
    if not 0 <= local < layer.local_num_experts:
        return
    what = expert_name(layer, shard_id)
    if dtype is not None and loaded.dtype != dtype:
        raise WeightLoadError(f"{what}: checkpoint tensor has dtype {loaded.dtype}, the quantized layout needs {dtype}")
    i_part, i_full, rank = layer.intermediate_size_per_partition, layer.intermediate_size, layer.parallel.tp_rank
    dst, src = param.data[local], loaded
    if per_shard:
        dst = dst[1 if shard == "w3" else 0]
    if shard == "w2":  # outputs: all of hidden; inputs: this rank's intermediate slice
        if in_dim is not None:
            size = i_part // in_unit if i_full != i_part else math.ceil(i_full / in_unit)
            src = narrow_rank(src, in_dim, math.ceil(i_full / in_unit), rank, size, what)
    elif out_dim is not None:  # gate / up: this rank's intermediate rows, into their half of w13
        size = i_part // out_unit if i_full != i_part else math.ceil(i_full / out_unit)
        src = narrow_rank(src, out_dim, math.ceil(i_full / out_unit), rank, size, what)
        dst = dst.narrow(out_dim, size if shard == "w3" else 0, size)
    check_shape(dst, src, what)
    dst.copy_(src)


def add_expert_param(layer: torch.nn.Module, name: str, tensor: torch.Tensor, w13: bool, **kwargs: Any) -> None:
    """Register `tensor` [local experts, ...] as `name` on the FusedMoE `layer`, loaded by `load_expert`;
    it counts as loaded once every local expert's projections (w1 and w3, or w2) arrived."""
    param = torch.nn.Parameter(tensor, requires_grad=False)
    layer.register_parameter(name, param)
    local = range(layer.expert_start, layer.expert_start + layer.local_num_experts)
    ids = ("w1", "w3") if w13 else ("w2",)
    set_weight_attrs(param, weight_loader=functools.partial(load_expert, layer, **kwargs),
                     shard_ids=tuple((e, s) for e in local for s in ids))


def frozen(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t.contiguous(), requires_grad=False)


def apply_experts(
    layer: torch.nn.Module,
    w13: torch.Tensor,
    w2: torch.Tensor,
    quant: Any,  # FusedMoEQuantConfig
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    residual: torch.Tensor | None,  # [num_tokens, hidden_size]
    fused_experts: Any,
    expert_weights: Any,  # e -> dequantized (w13 [2I, H], w2 [H, I]) in hidden's dtype
    quantize_input: Any = None,
) -> torch.Tensor:  # [num_tokens, hidden_size]
    """A quantized MoE method's forward: the bound kernel with `quant`, else the torch reference on the
    dequantized experts with work."""
    from keel.layers.fused_moe.torch_ref import fused_experts_torch

    if fused_experts is not None:
        return fused_experts(hidden, w13, w2, topk_weights, topk_ids, layer.activation, residual, quant)
    out = fused_experts_torch(hidden, w13, w2, topk_weights, topk_ids, layer.activation,
                              expert_weights=expert_weights, quantize_input=quantize_input)
    return out if residual is None else out + residual
