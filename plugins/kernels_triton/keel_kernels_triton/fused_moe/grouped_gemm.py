"""Fused MoE in Triton: tokens sorted by expert, one grouped GEMM per projection, weighted combine.

`fused_experts_triton` is what kernels-triton's `fused_experts` custom op (ops.py) runs for a bound
`FusedMoE` layer: on CUDA devices, or on the CPU under `TRITON_INTERPRET=1` (tests).

1. `moe_align_block_size` (align.py) sorts the (token, slot) pairs by expert and pads each expert's run to
   a multiple of BLOCK_M, so every block of BLOCK_M sorted rows belongs to exactly one expert. Experts
   that received no tokens get no block at all. Sizes are upper bounds known without a host sync;
   blocks past the real end exit immediately.
2. `_fused_moe_kernel` on w13: rows gathered from `hidden` by sorted id // top_k, times the block's
   expert weight -> gate_up [num_tokens * top_k, 2 * intermediate] in (token, slot) order.
3. `_fused_moe_kernel` on w2, multiplying each row by its routing weight -> [num_tokens * top_k, hidden].
   For silu the gated activation happens in this GEMM's A load (silu(gate) * up, rounded as the torch
   path rounds), so no intermediate tensor exists; other activations run in torch in between.
4. `moe_sum` (moe_sum.py) adds the top_k slots of each token (and optionally a residual such as the
   shared experts' output) in one small kernel.

Tile sizes come from `tile_config.get_moe_tile_configs` (tuned JSON files per device and shape, else a
heuristic); both GEMMs of a call use one block_m, the padding unit of step 1.

The kernels are jitted on first use and cached per interpreter mode, because Triton decides at
decoration time whether a function is compiled or interpreted.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from keel.layers.activation import get_act_and_mul_fn
from keel_kernels_triton.fused_moe.align import moe_align_block_size
from keel_kernels_triton.fused_moe.moe_sum import moe_sum
from keel_kernels_triton.fused_moe.tile_config import MoETileConfig, get_moe_tile_configs
from keel_kernels_triton.support import interpreter_enabled

# Activations the w2 GEMM computes in its A load; the rest run in torch between the GEMMs.
FUSED_ACTIVATIONS = ("silu", "swish")


def _fused_moe_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,
    K: tl.constexpr,  # the reduction size (hidden or intermediate): two values per model, so constexpr;
    # a runtime K trips older interpreters' range() over a scalar tensor
    num_valid_tokens,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    A_ROW_DIV: tl.constexpr,
    ACT_SILU: tl.constexpr,  # A is gate_up [rows, 2 * K]; the GEMM reads silu(A[:, :K]) * A[:, K:]
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # C[sorted rows, N-block] = A[rows // A_ROW_DIV] @ B[expert of this M-block].T (* routing weight)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_tokens_post_padded = tl.load(num_tokens_post_padded_ptr)
    if pid_m * BLOCK_M >= num_tokens_post_padded:
        return
    offs_token_id = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_token = tl.load(sorted_token_ids_ptr + offs_token_id)
    token_mask = offs_token < num_valid_tokens
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = tl.where(token_mask, offs_token // A_ROW_DIV, 0).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    # Only core builtins (tl.full, not tl.zeros / tl.cdiv): the jitted helpers of triton.language.standard
    # are bound to the mode (compiled or interpreted) triton was first imported in, which may not be ours.
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k in range((K + BLOCK_K - 1) // BLOCK_K):
        k_left = K - k * BLOCK_K
        a_mask = token_mask[:, None] & (offs_k[None, :] < k_left)
        if ACT_SILU:
            # Rounded twice to A's dtype, as torch's F.silu(gate) * up rounds each op's result.
            gate = tl.load(a_ptrs, mask=a_mask, other=0.0).to(tl.float32)
            up = tl.load(a_ptrs + K * stride_ak, mask=a_mask, other=0.0).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(a_ptr.dtype.element_ty).to(tl.float32)
            a = (act * up).to(a_ptr.dtype.element_ty)
        else:
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if UPCAST_DOT:  # the interpreter's dot misreads 16-bit floats; compiled kernels keep them
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + tl.where(token_mask, offs_token, 0), mask=token_mask, other=0.0)
        acc = acc * w[:, None]
    c_rows = tl.where(token_mask, offs_token, 0).to(tl.int64)
    c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=token_mask[:, None] & (offs_n[None, :] < N))


@functools.cache
def _jitted(interpret: bool) -> Any:
    del interpret  # part of the cache key only: triton.jit reads TRITON_INTERPRET itself
    # num_valid_tokens (tokens x top-k) only bounds a mask: not specializing on its divisibility by 16
    # keeps one compiled variant per tile config, so the startup warm-up's power-of-two token counts
    # cover every count a step can have (an H200 run compiled two more variants in its first batch).
    return triton.jit(_fused_moe_kernel, do_not_specialize=["num_valid_tokens"])


def invoke_fused_moe_kernel(
    a: torch.Tensor,  # [rows_a, K], or [rows_a, 2 * K] gate_up with act_silu
    b: torch.Tensor,  # [E, N, K]
    c: torch.Tensor,  # [num_tokens * top_k, N], written
    topk_weights: torch.Tensor | None,  # [num_tokens * top_k] float32
    sorted_ids: torch.Tensor,  # [max_padded] int32, padded to config.block_m
    expert_ids: torch.Tensor,  # [max_padded // config.block_m] int32
    total: torch.Tensor,  # [1] int32
    a_row_div: int,
    config: MoETileConfig,
    act_silu: bool = False,
) -> None:
    interpret = interpreter_enabled()
    kernel = _jitted(interpret)
    n, k = b.shape[1], b.shape[2]
    if expert_ids.numel() * config.block_m != sorted_ids.numel():
        raise ValueError(f"sorted ids were padded for another block_m than the tile config's {config.block_m}")
    grid = (expert_ids.numel(), -(-n // config.block_n))
    kernel[grid](
        a, b, c, topk_weights if topk_weights is not None else c, sorted_ids, expert_ids, total,
        n, k, c.shape[0],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div,
        ACT_SILU=act_silu,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        # float32 must not silently drop to TF32 on GPUs: fidelity tests compare at 1e-4.
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST_DOT=interpret and a.dtype != torch.float32,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def fused_experts_triton(
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden_size]
    w2: torch.Tensor,  # [num_experts, hidden_size, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    activation: str = "silu",
    residual: torch.Tensor | None = None,  # [num_tokens, hidden_size], added to the result
    *,
    tile_configs: tuple[MoETileConfig, MoETileConfig] | None = None,  # (w13, w2); default: get_moe_tile_configs
) -> torch.Tensor:  # [num_tokens, hidden_size], dtype of hidden
    """Same contract as `fused_experts_torch` (plus `residual`), computed by the grouped-GEMM kernel."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(hidden) if residual is None else residual.clone()
    hidden = hidden.contiguous()
    if tile_configs is None:
        tile_configs = get_moe_tile_configs(num_tokens, tuple(w13.shape), tuple(w2.shape), top_k, hidden.dtype,
                                            hidden.device, interpreter_enabled())
    c13, c2 = tile_configs
    if c13.block_m != c2.block_m:
        raise ValueError(f"both GEMMs of one MoE call need one block_m, got {c13.block_m} and {c2.block_m}")
    sorted_ids, expert_ids, total = moe_align_block_size(topk_ids, w13.shape[0], c13.block_m)
    rows = num_tokens * top_k
    gate_up = torch.empty(rows, w13.shape[1], dtype=hidden.dtype, device=hidden.device)
    invoke_fused_moe_kernel(hidden, w13, gate_up, None, sorted_ids, expert_ids, total, top_k, c13)
    fuse = activation.lower() in FUSED_ACTIVATIONS
    inter = gate_up if fuse else get_act_and_mul_fn(activation)(gate_up).contiguous()  # [rows, intermediate]
    down = torch.empty(rows, w2.shape[1], dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    invoke_fused_moe_kernel(inter, w2, down, weights, sorted_ids, expert_ids, total, 1, c2, act_silu=fuse)
    return moe_sum(down.view(num_tokens, top_k, -1), residual=residual)
