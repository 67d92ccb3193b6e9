"""Weight-only FP8 GEMV for a few rows (decode at M <= 4-8): no tensor cores, no MMA padding of M.

y[m, n] = sum over K groups g of (sum_{k in g} x[m, k] * w_q[n, k]) * w_s[n // GROUP_N, g]. A program owns
BLOCK_N weight rows of one K split and every M row (BLOCK_M >= M): each step loads a [BLOCK_N, BLOCK_K]
fp8 tile (contiguous along K: wide vector loads), widens it to float32 and multiply-adds it with the
[BLOCK_M, BLOCK_K] activations, scaled per row (the tile lies in one K group); the products sum over K
once, after the loop. With one scale group over K (per-tensor / per-channel) the scale multiplies the
sums once after the loop instead of every element (one multiply per weight element fewer: the loop is
bound by issuing its conversion and multiply-adds as much as by the weight's bytes, 66% of copy
bandwidth on the H200 at 186f88e; predicted ~8-12% faster at M = 1, unmeasured). The grid is
(N / BLOCK_N, splits, M / BLOCK_M) and writes y (one split) or the float32 partials `splitk_reduce` sums.
Launched through `fp8_triton.fp8_weight_only_gemm` with a "gemv" `SmallMPlan`.

The plan's num_stages is the loop's pipeline depth (`launch_args`, STAGES). A plain loop loads a tile and
multiplies it in the same iteration, so each iteration pays a load's latency with one tile in flight, and the
launch's num_stages does not change that: Triton pipelines a loop without a dot only from
`tl.range(num_stages=...)`. With STAGES > 1 the weights and inputs of STAGES - 1 tiles ahead are copied into
shared memory (cp.async) while a tile is multiplied (sm_90 SASS, 1x8x512: 136 -> 158 loop instructions, 70 -> 72
registers, 5 KB of shared memory a stage). Two hand-written forms before it (inputs loaded in the weight tile's
layout; the next tile's weights carried in registers, 1967f60) lost or tied on an H100 and are gone
(h100-quant-small-m-gemv-forms-f7e3a77.json). Predicted (H200): the M = 1 fp8_row GEMV over Llama-8B's four
layers 80.4 -> ~60 us (the weight's bytes at copy bandwidth: ~52). Measured (H100,
h100-quant-small-m-pipelined-83ecae0.json): 1x8x512 at 3 stages 92.5 -> 85.2 us, every layer faster; with
activations quantized in the kernel (ACT > 0) pipelining lost ~1.5-1.8x.

With ACT > 0 it is a W8A8 GEMV (`fp8_w8a8_small_m_triton.fp8_w8a8_small_m_gemm` with a "gemv" plan): the
activations are quantized in the kernel with `fp8_quant_triton`'s helpers -- the e4m3 values and scales
`quantize_activations` gives -- and the products of two e4m3 values are exact in float32, so the result
is the W8A8 math up to float32 summation order, at the weight-only GEMV's cost (no MMA padding of M = 1):
ACT 1 per token (a prologue takes the whole row's amax, AMAX_K inputs a load), 2 per token and GROUP_K
inputs (the K tile is the group), 3 static (the one input_scale).
"""

from __future__ import annotations

import triton
import triton.language as tl

from keel_quantization.fp8_quant_triton import _dynamic_scale, _to_e4m3
from keel_quantization.pdl import pdl_enter
from keel_quantization.splitk_reduce import split_range


@triton.jit
def _w_tile(b_ptr, offs_n, mask_n, k, k_end, stride_bn, stride_bk):
    """The e4m3 weight tile [BN, BK] of inputs k (0 past k_end or N)."""
    return tl.load(b_ptr + offs_n[:, None] * stride_bn + k[None, :] * stride_bk,
                   mask=mask_n[:, None] & (k < k_end)[None, :], other=0.0)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, b_ptr, bs_ptr, c_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_bn, stride_bk, stride_bsn, stride_bsk, stride_cs, stride_cm, stride_cn,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_AFTER: tl.constexpr,  # one scale group over K (per-tensor / per-channel): scaled once, after the loop
    static_ptr=None,  # float32 [1], ACT 3
    ACT: tl.constexpr = 0,  # 0 weight-only; activations quantized: 1 per token, 2 per token and group, 3 static
    AMAX_K: tl.constexpr = 1,  # inputs a row per load of the per-token amax prologue (ACT 1)
    PDL: tl.constexpr = False,
    STAGES: tl.constexpr = 1,  # the plan's num_stages: > 1 pipelines the loop's loads through shared memory
):
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # BLOCK_M 1: [1], broadcast over K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start, k_end = split_range(pid_s, K, K_PER_SPLIT)
    if ACT == 1:  # the whole row's amax, whatever this program's split: the scale quant_fp8 takes
        offs_a = tl.arange(0, AMAX_K)
        amax = tl.zeros((BLOCK_M, AMAX_K), dtype=tl.float32)
        for a0 in range(0, K, AMAX_K):
            ka = a0 + offs_a
            xa = tl.load(x_ptr + offs_m[:, None] * stride_xm + ka[None, :] * stride_xk,
                         mask=mask_m[:, None] & (ka < K)[None, :], other=0.0).to(tl.float32)  # [BM, AK]
            amax = tl.maximum(amax, tl.abs(xa))
        a_s = _dynamic_scale(tl.max(amax, axis=1))  # [BM]; max is exact, so any order gives quant_fp8's
    elif ACT == 3:
        a_s = tl.load(static_ptr + offs_m * 0).to(tl.float32)  # [BM], the one static scale
    # products accumulate elementwise and are summed over K once after the loop: no cross-thread
    # reduction per tile (one M row: a 2-D accumulator)
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    # tl.range's num_stages: Triton pipelines a loop without a dot only when the loop asks (see the docstring)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        k = k0 + offs_k
        mask_k = k < k_end
        w = _w_tile(b_ptr, offs_n, mask_n, k, k_end, stride_bn, stride_bk).to(tl.float32)  # [BN, BK]
        if not SCALE_AFTER:
            b_s = tl.load(bs_ptr + (offs_n // GROUP_N) * stride_bsn + (k0 // GROUP_K) * stride_bsk,
                          mask=mask_n, other=0.0)  # [BN]: the tile lies in one K group
            w = w * b_s[:, None]
        if BLOCK_M == 1 and ACT == 0:
            x = tl.load(x_ptr + offs_m * stride_xm + k * stride_xk, mask=mask_m & mask_k, other=0.0)  # [BK]
            acc += w * x.to(tl.float32)[None, :]
        else:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)  # [BM, BK]
            if ACT == 2:  # this tile is its group (BLOCK_K == GROUP_K)
                g_s = _dynamic_scale(tl.max(tl.abs(x), axis=1))  # [BM]
                x = _to_e4m3(x, tl.broadcast_to(g_s[:, None], x.shape)) * g_s[:, None]
            elif ACT != 0:  # e4m3 values; the row's scale multiplies the sums after the loop
                x = _to_e4m3(x, tl.broadcast_to(a_s[:, None], x.shape))
            if BLOCK_M == 1:
                acc += w * tl.reshape(x, (BLOCK_K,))[None, :]
            else:
                acc += x[:, None, :] * w[None, :, :]
    if BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[None, :]  # [1, BN]
    else:
        out = tl.sum(acc, axis=2)  # [BM, BN]
    if ACT == 1 or ACT == 3:
        out = out * a_s[:, None]
    if SCALE_AFTER:
        out = out * tl.load(bs_ptr + (offs_n // GROUP_N) * stride_bsn, mask=mask_n, other=0.0)[None, :]
    c_ptr += pid_s * stride_cs
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, out.to(c_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def launch_args(plan) -> dict:
    """The gemv plan's Triton options: its warps, and its num_stages as the loop's pipeline depth (STAGES)."""
    return {"num_warps": plan.num_warps, "STAGES": plan.num_stages or 1}
