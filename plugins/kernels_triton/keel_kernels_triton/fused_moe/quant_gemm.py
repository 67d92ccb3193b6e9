"""Fused MoE over quantized experts: the grouped GEMMs dequantize expert weights tile by tile.

`fused_experts_quant_triton` is what the `fused_experts` custom op runs for a FusedMoE layer whose
quantization method hands it a `FusedMoEQuantConfig` (`keel.layers.fused_moe.quant_config`); the
alignment, tile configs and combine are the unquantized path's (grouped_gemm.py).

- "fp8_block" (W8A8, DeepSeek-V3): each GEMM's input is quantized per token and bk-input group
  (`per_token_group_quant_fp8`, the one function the torch reference uses too, or the config's
  `quantize_input`, the same numbers in one launch); the kernel multiplies fp8
  tiles (native fp8 MMA on sm89+) and scales each K tile's partial product by its rows' activation
  scales and its block's weight scales: acc += (a_q @ b_q) * a_s[:, None] * b_s[None, :]. BLOCK_K is
  capped at bk so one tile lies in one scale group.
- "int4" (W4A16, GPTQ / AWQ): a K tile of the packed weight is unpacked in registers and dequantized
  through g_idx-gathered scales and zeros, then multiplied in the activation dtype (as int4_gemm for
  linear layers).

The gated activation runs as a step of its own between the GEMMs (it must be quantized before the fp8 down
GEMM): for fp8 silu experts in one launch with its quantization where the config has `quantize_gated_input`.
K splits are not used here. Runs compiled on CUDA, interpreted on the CPU (tests, tiny shapes).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import triton
import triton.language as tl

from keel.layers.fp8_utils import per_token_group_quant_fp8
from keel.layers.fused_moe.quant_config import FusedMoEQuantConfig
from keel_kernels_triton.fused_moe.align import moe_align_block_size
from keel_kernels_triton.fused_moe.grouped_gemm import FUSED_ACTIVATIONS, act_and_mul, live_block_bound
from keel_kernels_triton.fused_moe.moe_sum import moe_sum
from keel_kernels_triton.fused_moe.tile_config import MoETileConfig, get_moe_tile_configs
from keel_kernels_triton.support import interpreter_enabled

KINDS = ("fp8_block", "int4")
FP8_BLOCK, INT4 = 1, 2


def _fused_moe_quant_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, b_zero_ptr, b_gidx_ptr, c_ptr,
    topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    N, K: tl.constexpr, num_valid_tokens,
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_be, stride_bn, stride_bk,  # fp8: b [E, N, K]; int4: packed [E, K / 8, N], stride_bk per word row
    stride_se, stride_sn, stride_sk,  # fp8: [E, N / bn, K / bk]; int4 scales and zeros [E, groups, N] (sk: group)
    stride_ge, stride_gk,  # int4 g_idx [E, K]
    stride_cm, stride_cn,
    A_ROW_DIV: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, QUANT: tl.constexpr,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
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
        if QUANT == 1:  # fp8 block: one scale group per tile
            b = tl.load(b_ptr + expert * stride_be + k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                        mask=kn_mask, other=0.0)  # [BK, BN] fp8
            g = (kt * BLOCK_K) // GROUP_K
            a_s = tl.load(a_scale_ptr + a_rows * stride_asm + g * stride_ask, mask=token_mask, other=0.0)  # [BM]
            b_s = tl.load(b_scale_ptr + expert * stride_se + (offs_n // GROUP_N) * stride_sn + g * stride_sk,
                          mask=n_mask, other=0.0)  # [BN]
            if UPCAST_DOT:  # the interpreter has no fp8 dot: the same products in float32
                part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(a, b)
            acc += part * a_s[:, None] * b_s[None, :]
        else:  # int4: unpack and dequantize the tile
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
    return triton.jit(_fused_moe_quant_kernel, do_not_specialize=["num_valid_tokens"])


def invoke_fused_moe_quant_kernel(
    a: torch.Tensor,  # [rows_a, K]: fp8 (fp8_block) or the activation dtype (int4)
    a_scale: torch.Tensor | None,  # fp8_block: float32 [rows_a, ceil(K / bk)]
    b: torch.Tensor,  # fp8 [E, N, K] or int32 [E, K / 8, N]
    b_scale: torch.Tensor,  # fp8: [E, ceil(N / bn), ceil(K / bk)]; int4: [E, groups, N]
    b_zeros: torch.Tensor | None,  # int4: [E, groups, N]
    b_g_idx: torch.Tensor | None,  # int4: int32 [E, K]
    c: torch.Tensor,  # [num_tokens * top_k, N], written
    topk_weights: torch.Tensor | None,  # [num_tokens * top_k] float32
    sorted_ids: torch.Tensor, expert_ids: torch.Tensor, total: torch.Tensor,
    a_row_div: int, config: MoETileConfig, quant: FusedMoEQuantConfig,
) -> None:
    interpret = interpreter_enabled()
    fp8 = quant.kind == "fp8_block"
    k = a.shape[1]
    n = b.shape[1] if fp8 else b.shape[2]
    bn, bk = quant.block_shape if fp8 else (1, 1)
    block_k = min(config.block_k, bk) if fp8 else config.block_k
    rows = c.shape[0]
    grid = (min(expert_ids.numel(), live_block_bound(rows, b.shape[0], config.block_m)), -(-n // config.block_n))
    if fp8:
        s_strides = (b_scale.stride(0), b_scale.stride(1), b_scale.stride(2))
        b_strides = (b.stride(0), b.stride(1), b.stride(2))
    else:
        s_strides = (b_scale.stride(0), b_scale.stride(2), b_scale.stride(1))
        b_strides = (b.stride(0), b.stride(2), b.stride(1))
    _jitted(interpret)[grid](
        a, a_scale if fp8 else a, b, b_scale, b_zeros if b_zeros is not None else b_scale,
        b_g_idx if b_g_idx is not None else sorted_ids, c,
        topk_weights if topk_weights is not None else c, sorted_ids, expert_ids, total,
        n, k, rows,
        a.stride(0), a.stride(1), a_scale.stride(0) if fp8 else 0, a_scale.stride(1) if fp8 else 0,
        *b_strides, *s_strides,
        b_g_idx.stride(0) if b_g_idx is not None else 0, b_g_idx.stride(1) if b_g_idx is not None else 0,
        c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, MUL_ROUTED_WEIGHT=topk_weights is not None, QUANT=FP8_BLOCK if fp8 else INT4,
        # fp8 MMA instructions take K tiles of 32 and more; the interpreter has no fp8 dot
        GROUP_N=bn, GROUP_K=bk, UPCAST_DOT=interpret or a.dtype == torch.float32 or (fp8 and block_k < 32),
        DOT_PRECISION="ieee" if a.dtype == torch.float32 or fp8 else "tf32",
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
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
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(hidden) if residual is None else residual.clone()
    fp8 = quant.kind == "fp8_block"
    e = w13.shape[0]
    h = hidden.shape[1]
    n13 = w13.shape[1] if fp8 else w13.shape[2]
    i = n13 // 2
    if tile_configs is None:
        tile_configs = get_moe_tile_configs(num_tokens, (e, n13, h), (e, h, i), top_k, hidden.dtype, hidden.device,
                                            interpreter_enabled())
    c13, c2 = (dataclasses.replace(c, split_k=1) for c in tile_configs)
    sorted_ids, expert_ids, total = moe_align_block_size(topk_ids, e, c13.block_m)
    rows = num_tokens * top_k
    hidden = hidden.contiguous()
    group = quant.block_shape[1] if fp8 else 0
    quantize = quant.quantize_input or per_token_group_quant_fp8

    def gemm(x: tuple[torch.Tensor, torch.Tensor | None], w: torch.Tensor, scale: torch.Tensor, zeros: Any,
             g_idx: Any, n: int, weights: torch.Tensor | None, row_div: int, config: MoETileConfig) -> torch.Tensor:
        out = torch.empty(rows, n, dtype=hidden.dtype, device=hidden.device)
        invoke_fused_moe_quant_kernel(*x, w, scale, zeros, g_idx, out, weights, sorted_ids, expert_ids, total,
                                      row_div, config, quant)
        return out

    def gemm_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return quantize(x, group) if fp8 else (x, None)

    gate_up = gemm(gemm_input(hidden), w13, quant.w13_scale, quant.w13_zeros, quant.w13_g_idx, n13, None, top_k,
                   c13)
    if fp8 and quant.quantize_gated_input is not None and activation.lower() in FUSED_ACTIVATIONS:
        act = quant.quantize_gated_input(gate_up, group)  # silu and its quantization in one launch
    else:
        act = gemm_input(act_and_mul(gate_up, activation))  # [rows, I]: one silu_and_mul launch on a GPU
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    down = gemm(act, w2, quant.w2_scale, quant.w2_zeros, quant.w2_g_idx, h, weights, 1, c2)
    return moe_sum(down.view(num_tokens, top_k, -1), torch.empty_like(hidden), residual=residual)
