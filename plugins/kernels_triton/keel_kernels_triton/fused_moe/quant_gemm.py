"""Fused MoE over quantized experts: the grouped GEMMs dequantize expert weights tile by tile.

`fused_experts_quant_triton` is what the `fused_experts` custom op runs for a FusedMoE layer whose
quantization method hands it a `FusedMoEQuantConfig` (`keel.layers.fused_moe.quant_config`):

- "fp8_block" (DeepSeek-V3): the unquantized path's kernel in its fp8 weight mode (grouped_gemm.py:
  weight-only at decode sizes, W8A8 above; gemv, split-K, TMA weight tiles and the fused activation as
  for 16-bit experts).
- "int4" (W4A16, GPTQ / AWQ): this module's kernel. A K tile of the packed weight is unpacked in
  registers and dequantized through g_idx-gathered scales and zeros, then multiplied in the activation
  dtype (as int4_gemm for linear layers); the alignment, tile configs and combine are the unquantized
  path's, the gated activation runs in torch between the GEMMs, K is not split.

Runs compiled on CUDA, interpreted on the CPU (tests, tiny shapes).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import triton
import triton.language as tl

from keel.layers.activation import get_act_and_mul_fn
from keel.layers.fused_moe.quant_config import FusedMoEQuantConfig
from keel_kernels_triton.fused_moe.align import moe_align_block_size
from keel_kernels_triton.fused_moe.grouped_gemm import fused_experts_triton, live_block_bound
from keel_kernels_triton.fused_moe.moe_sum import moe_sum
from keel_kernels_triton.fused_moe.tile_config import MoETileConfig, get_moe_tile_configs
from keel_kernels_triton.support import interpreter_enabled

KINDS = ("fp8_block", "int4")


def _fused_moe_int4_kernel(
    a_ptr, b_ptr, b_scale_ptr, b_zero_ptr, b_gidx_ptr, c_ptr,
    topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    N, K: tl.constexpr, num_valid_tokens,
    stride_am, stride_ak,
    stride_be, stride_bn, stride_bk,  # packed [E, K / 8, N], stride_bk per word row
    stride_se, stride_sn, stride_sk,  # scales and zeros [E, groups, N] (sk: group)
    stride_ge, stride_gk,  # g_idx [E, K]
    stride_cm, stride_cn,
    A_ROW_DIV: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
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
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = tl.where(token_mask, offs_token // A_ROW_DIV, 0).to(tl.int64)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for kt in range((K + BLOCK_K - 1) // BLOCK_K):
        k = kt * BLOCK_K + offs_k
        k_mask = k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=token_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        kn_mask = k_mask[:, None] & n_mask[None, :]
        packed = tl.load(b_ptr + expert * stride_be + (k[:, None] // 8) * stride_bk + offs_n[None, :] * stride_bn,
                         mask=kn_mask, other=0)  # [BK, BN] int32
        q = (packed >> ((k[:, None] % 8) * 4)) & 0xF
        grp = tl.load(b_gidx_ptr + expert * stride_ge + k * stride_gk, mask=k_mask, other=0)  # [BK]
        sz = expert * stride_se + grp[:, None] * stride_sk + offs_n[None, :] * stride_sn
        s = tl.load(b_scale_ptr + sz, mask=kn_mask, other=0.0).to(tl.float32)
        z = tl.load(b_zero_ptr + sz, mask=kn_mask, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - z) * s  # [BK, BN], zero outside K / N
        if UPCAST_DOT:
            acc += tl.dot(a.to(tl.float32), w, input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(a, w.to(a.dtype), input_precision=DOT_PRECISION)
    if MUL_ROUTED_WEIGHT:
        wt = tl.load(topk_weights_ptr + tl.where(token_mask, offs_token, 0), mask=token_mask, other=0.0)
        acc = acc * wt[:, None]
    c_rows = tl.where(token_mask, offs_token, 0).to(tl.int64)
    tl.store(c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=token_mask[:, None] & n_mask[None, :])


@functools.cache
def _jitted(interpret: bool) -> Any:
    del interpret  # part of the cache key only (see grouped_gemm._jitted)
    return triton.jit(_fused_moe_int4_kernel, do_not_specialize=["num_valid_tokens"])


def invoke_fused_moe_int4_kernel(
    a: torch.Tensor,  # [rows_a, K] in the activation dtype
    b: torch.Tensor,  # int32 [E, K / 8, N]
    b_scale: torch.Tensor,  # [E, groups, N]
    b_zeros: torch.Tensor,  # [E, groups, N]
    b_g_idx: torch.Tensor,  # int32 [E, K]
    c: torch.Tensor,  # [num_tokens * top_k, N], written
    topk_weights: torch.Tensor | None,  # [num_tokens * top_k] float32
    sorted_ids: torch.Tensor, expert_ids: torch.Tensor, total: torch.Tensor,
    a_row_div: int, config: MoETileConfig,
) -> None:
    interpret = interpreter_enabled()
    k = a.shape[1]
    n = b.shape[2]
    rows = c.shape[0]
    grid = (min(expert_ids.numel(), live_block_bound(rows, b.shape[0], config.block_m)), -(-n // config.block_n))
    _jitted(interpret)[grid](
        a, b, b_scale, b_zeros, b_g_idx, c,
        topk_weights if topk_weights is not None else c, sorted_ids, expert_ids, total,
        n, k, rows,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(2), b.stride(1),
        b_scale.stride(0), b_scale.stride(2), b_scale.stride(1),
        b_g_idx.stride(0), b_g_idx.stride(1),
        c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, MUL_ROUTED_WEIGHT=topk_weights is not None,
        UPCAST_DOT=interpret or a.dtype == torch.float32,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def quant_kernel_supports(quant: FusedMoEQuantConfig | None) -> bool:
    """Whether the kernel implements these experts (bind time): fp8 blocks whose input group is a power of
    two of at least 16 (a whole number of K tiles per group), or int4."""
    if quant is None or quant.kind not in KINDS:
        return False
    if quant.kind == "fp8_block":
        bk = quant.block_shape[1]
        return bk >= 16 and bk & (bk - 1) == 0
    return True


def fused_experts_quant_triton(
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    w13: torch.Tensor,  # fp8 [E, 2I, H] or int32 [E, H / 8, 2I]
    w2: torch.Tensor,  # fp8 [E, H, I] or int32 [E, I / 8, H]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    activation: str,
    residual: torch.Tensor | None,  # [num_tokens, hidden_size]
    quant: FusedMoEQuantConfig,
    *,
    tile_configs: tuple[MoETileConfig, MoETileConfig] | None = None,
) -> torch.Tensor:  # [num_tokens, hidden_size], dtype of hidden
    """The `fused_experts` contract for quantized experts (see the module docstring)."""
    if not quant_kernel_supports(quant):
        raise ValueError(f"fused_experts_quant_triton does not implement {quant.kind} experts {quant.block_shape}")
    if quant.kind == "fp8_block":
        return fused_experts_triton(hidden, w13, w2, topk_weights, topk_ids, activation, residual,
                                    tile_configs=tile_configs, fp8=quant)
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(hidden) if residual is None else residual.clone()
    e = w13.shape[0]
    h = hidden.shape[1]
    n13 = w13.shape[2]
    i = n13 // 2
    if tile_configs is None:
        tile_configs = get_moe_tile_configs(num_tokens, (e, n13, h), (e, h, i), top_k, hidden.dtype, hidden.device,
                                            interpreter_enabled())
    c13, c2 = (dataclasses.replace(c, split_k=1) for c in tile_configs)
    sorted_ids, expert_ids, total = moe_align_block_size(topk_ids, e, c13.block_m)
    rows = num_tokens * top_k
    hidden = hidden.contiguous()

    def gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zeros: Any, g_idx: Any, n: int,
             weights: torch.Tensor | None, row_div: int, config: MoETileConfig) -> torch.Tensor:
        out = torch.empty(rows, n, dtype=hidden.dtype, device=hidden.device)
        invoke_fused_moe_int4_kernel(x, w, scale, zeros, g_idx, out, weights, sorted_ids, expert_ids, total,
                                     row_div, config)
        return out

    gate_up = gemm(hidden, w13, quant.w13_scale, quant.w13_zeros, quant.w13_g_idx, n13, None, top_k, c13)
    act = get_act_and_mul_fn(activation)(gate_up).contiguous()  # [rows, I]
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    down = gemm(act, w2, quant.w2_scale, quant.w2_zeros, quant.w2_g_idx, h, weights, 1, c2)
    return moe_sum(down.view(num_tokens, top_k, -1), torch.empty_like(hidden), residual=residual)
