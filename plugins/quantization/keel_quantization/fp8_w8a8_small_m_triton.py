"""W8A8 FP8 GEMM for a few tokens (decode, M <= 32): y = (quantized x) @ w_q^T, activation quantization fused.

Swapped operands: a program computes y^T [BLOCK_N, BLOCK_M] = w_q [BLOCK_N, K] . xq^T [K, BLOCK_M], so the
weight's rows are the MMA's M dimension (64 or 128 a program) and the tokens its N dimension (padded to
BLOCK_M >= 16, the MMA's minimum): e4m3 x e4m3 tl.dot with float32 accumulation, fp8 wgmma on sm_90,
the weight never widened (the weight-only GEMM converts every weight element; at M = 1 that conversion,
not the bytes, bounds it).

The activations are quantized in the kernel with `fp8_quant_triton`'s helpers, so the e4m3 values and
scales are bit-equal to `quantize_activations` (the large-M path's) and the result is the large-M W8A8
math up to float32 summation order -- a request's numbers do not depend on how many tokens its step has:
- "dynamic_token": one scale per token over all of K, taken in a prologue over the whole row before the
  weight loop (a K split still scales by the whole row's amax; the row is small at M <= 32);
- "dynamic_group" (block fp8): one scale per token and GROUP_K inputs, taken per K tile from the tile's
  group (a K tile lies in one group);
- "static": the one input_scale.
Only the QUANT_ROWS (>= M, a power of two) token rows that exist are loaded and quantized; the tile is
padded with zero rows to BLOCK_M only for the MMA. Weight scales: one group over K (per-tensor /
per-channel, kept per row) multiplies the sums once after the loop; block scales multiply each K tile's
partial product. The grid is (N / BLOCK_N, splits, M / BLOCK_M); a K split writes float32 partials that
`splitk_reduce` sums in a fixed order (deterministic, nothing to zero: CUDA graphs capture the pair).

On the CPU interpreter (no fp8 dot) the e4m3-valued float32 tiles multiply in float32: the same products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from keel_quantization.fp8_quant_triton import _dynamic_scale, _to_e4m3
from keel_quantization.pdl import pdl_enter, pdl_kwargs
from keel_quantization.small_m_plan import SmallMPlan, w8a8_plan
from keel_quantization.splitk_reduce import SplitKOutput, split_range

ACTIVATIONS = {"static": 0, "dynamic_token": 1, "dynamic_group": 2}
AMAX_ELEMENTS = 4096  # elements of x per load of the per-token amax prologue
GEMV_ACT = {0: 3, 1: 1, 2: 2}  # ACTIVATIONS -> fp8_gemv_triton's ACT (0 there: weight-only)
# sm_90's fp8 MMA (wgmma) keeps ~14 bits of its running sum (DeepSeek-V3's report), and Triton lets it run
# over a dot's whole K and, where `acc += dot` fuses (one weight scale over K: per-tensor / per-channel),
# over the whole loop: 1e-3 of |y| off the exact W8A8 product at K = 512 on the H200 (float32), while the
# large-M Triton GEMM (16-token tiles) was within 1e-7. Promoted every 128 inputs it was 1.9e-4; after every
# wgmma (32 inputs) 5.3e-5 -- a float32 add per accumulator per instruction, no cost seen at batch 1.
PROMOTE_K = 32


@triton.jit
def _pad_rows(v, ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    """v [ROWS, BLOCK_K] -> [BLOCK_M, BLOCK_K], rows past ROWS zero (the MMA's padding of the tokens)."""
    if ROWS < BLOCK_M:
        v = tl.reshape(tl.broadcast_to(v[None, :, :], (BLOCK_M // ROWS, ROWS, v.shape[1])), (BLOCK_M, v.shape[1]))
        v = tl.where((tl.arange(0, BLOCK_M) < ROWS)[:, None], v, 0.0)
    return v


@triton.jit
def _pad_scales(s, ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    """s [ROWS] -> [BLOCK_M] (one per MMA column), zero past ROWS."""
    if ROWS < BLOCK_M:
        s = tl.reshape(tl.broadcast_to(s[None, :], (BLOCK_M // ROWS, ROWS)), (BLOCK_M,))
        s = tl.where(tl.arange(0, BLOCK_M) < ROWS, s, 0.0)
    return s


@triton.jit
def _fp8_w8a8_small_m_kernel(
    x_ptr, w_ptr, ws_ptr, static_ptr, c_ptr,
    M, N, K, K_PER_SPLIT,  # split s (program_id 1) covers inputs [s * K_PER_SPLIT, (s + 1) * K_PER_SPLIT)
    stride_xm, stride_xk, stride_wn, stride_wk, stride_wsn, stride_wsk, stride_cs, stride_cm, stride_cn,
    ACT: tl.constexpr,  # 0 static, 1 per token, 2 per token and GROUP_K inputs
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,  # GROUP_K: the K scale group where ACT 2 or W_PER_TILE
    W_PER_TILE: tl.constexpr,  # block weight scales: one per K tile; else one group over K, after the loop
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    QUANT_ROWS: tl.constexpr,  # token rows loaded and quantized: a power of two >= the tile's tokens
    AMAX_K: tl.constexpr,  # inputs a row per load of the per-token amax prologue (ACT 1)
    PROMOTE_K: tl.constexpr,  # the fp8 MMA's sums move to float32 every PROMOTE_K inputs (<= BLOCK_K)
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_q = tl.program_id(2) * BLOCK_M + tl.arange(0, QUANT_ROWS)  # [QR] the tokens that exist (and a few)
    mask_q = offs_q < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k_start, k_end = split_range(pid_s, K, K_PER_SPLIT)
    if ACT == 0:
        a_s = tl.load(static_ptr + offs_q * 0).to(tl.float32)  # [QR], the one static scale
    elif ACT == 1:  # the whole row's amax, whatever this program's split: the scale quant_fp8 takes
        # in chunks of AMAX_K (>= BLOCK_K) inputs: the loop waits on each load, so few, wide ones
        offs_a = tl.arange(0, AMAX_K)
        amax = tl.zeros((QUANT_ROWS, AMAX_K), dtype=tl.float32)
        for k0 in range(0, K, AMAX_K):
            k = k0 + offs_a
            x = tl.load(x_ptr + offs_q[:, None] * stride_xm + k[None, :] * stride_xk,
                        mask=mask_q[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)  # [QR, AK]
            amax = tl.maximum(amax, tl.abs(x))
        a_s = _dynamic_scale(tl.max(amax, axis=1))  # [QR]; max is exact, so any order gives quant_fp8's
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < k_end
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :] * stride_wk,
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BN, BK] fp8
        x = tl.load(x_ptr + offs_q[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=mask_q[:, None] & mask_k[None, :], other=0.0).to(tl.float32)  # [QR, BK]
        if ACT == 2:  # this tile's group, whole: a split boundary may fall inside it when BK < GROUP_K
            if GROUP_K == BLOCK_K:
                gmax = tl.max(tl.abs(x), axis=1)
            else:
                gmax = tl.zeros((QUANT_ROWS,), dtype=tl.float32)
                for c in tl.static_range(GROUP_K // BLOCK_K):
                    kg = (k0 // GROUP_K) * GROUP_K + c * BLOCK_K + offs_k
                    xg = tl.load(x_ptr + offs_q[:, None] * stride_xm + kg[None, :] * stride_xk,
                                 mask=mask_q[:, None] & (kg < K)[None, :], other=0.0).to(tl.float32)
                    gmax = tl.maximum(gmax, tl.max(tl.abs(xg), axis=1))
            a_s = _dynamic_scale(gmax)  # [QR]
        xq = _pad_rows(_to_e4m3(x, tl.broadcast_to(a_s[:, None], x.shape)), QUANT_ROWS, BLOCK_M)  # [BM, BK]
        if UPCAST_DOT:  # e4m3 values in float32: the products the fp8 MMA makes, exactly
            part = tl.dot(w.to(tl.float32), tl.trans(xq), input_precision="ieee")  # [BN, BM]
        else:  # exact products (xq is on the e4m3 grid); sums promoted to float32 every PROMOTE_K inputs
            part = tl.dot(w, tl.trans(xq.to(w_ptr.dtype.element_ty)), max_num_imprecise_acc=PROMOTE_K)
        if ACT == 2:
            part = part * _pad_scales(a_s, QUANT_ROWS, BLOCK_M)[None, :]
        if W_PER_TILE:
            w_s = tl.load(ws_ptr + (offs_n // GROUP_N) * stride_wsn + (k0 // GROUP_K) * stride_wsk, mask=mask_n,
                          other=0.0)  # [BN]: the tile lies in one K group
            part = part * w_s[:, None]
        acc += part
    if ACT != 2:
        acc = acc * _pad_scales(a_s, QUANT_ROWS, BLOCK_M)[None, :]
    if not W_PER_TILE:
        acc = acc * tl.load(ws_ptr + (offs_n // GROUP_N) * stride_wsn, mask=mask_n, other=0.0)[:, None]
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    c_ptr += pid_s * stride_cs  # one split: y itself; more: this split's float32 partials
    tl.store(c_ptr + offs_m[None, :] * stride_cm + offs_n[:, None] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(offs_m < M)[None, :] & mask_n[:, None])


def misfit(k: int) -> str | None:
    """Why a layer of K inputs cannot take this GEMM (None: it can)."""
    if k % 16:  # Triton's wide loads of a weight row need rows on a 16-byte grid
        return f"K {k} is not a multiple of 16"
    return None


def fp8_w8a8_small_m_gemm(
    x: torch.Tensor,  # [M, K] in the model dtype
    w_q: torch.Tensor,  # e4m3 [N, K]
    w_s: torch.Tensor,  # float32 [ceil(N / group_n), ceil(K / group_k)]; per row: [N, 1] with group_k = K
    group_n: int,
    group_k: int,
    activation: str,  # "static" | "dynamic_token" | "dynamic_group" (per token and group_k inputs)
    input_scale: torch.Tensor | None = None,  # float32 [1], "static"
    out: torch.Tensor | None = None,  # [M, N] in x's dtype, written in full
    plan: SmallMPlan | None = None,  # default small_m_plan.w8a8_plan (per shape)
) -> torch.Tensor:  # [M, N] in x's dtype
    m, k = x.shape
    n = w_q.shape[0]
    groups = -(-k // group_k)
    if w_q.shape[1] != k or w_s.shape != (-(-n // group_n), groups):
        raise ValueError(f"fp8_w8a8_small_m_gemm: shapes do not fit: x {tuple(x.shape)}, w {tuple(w_q.shape)}, "
                         f"w_s {tuple(w_s.shape)}, groups ({group_n}, {group_k})")
    act = ACTIVATIONS[activation]
    if act == 2 and group_k >= k:  # one group over the row: the per-token scale
        act = 1
    plan = plan or w8a8_plan(m, n, k, group_k)
    bm, bn, bk = plan.block_m, plan.block_n, plan.block_k
    w_per_tile = group_k < k
    if (plan.kernel not in ("dot_w8a8", "gemv") or ((act == 2 or w_per_tile) and group_k % bk)
            or (plan.kernel == "gemv" and act == 2 and bk != group_k)):
        raise ValueError(f"fp8_w8a8_small_m_gemm: plan {plan} does not fit scale groups of {group_k}")
    if act == 0 and input_scale is None:
        raise ValueError("fp8_w8a8_small_m_gemm: static activations need input_scale")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return y
    dst = SplitKOutput(y, k, bk, plan.split_k)
    scs, scm, scn = dst.strides
    quant_rows = bm if m > bm else triton.next_power_of_2(m)
    # the prologue's chunk: ~4096 elements a load (32 a thread at 4 warps), K's whole row where it fits
    amax_k = max(bk, min(triton.next_power_of_2(k), AMAX_ELEMENTS // quant_rows))
    static = input_scale.float().reshape(1) if act == 0 else w_s  # unread unless static
    if plan.kernel == "gemv":  # no MMA: the weight-only GEMV's loop on the quantized activations
        from keel_quantization.fp8_gemv_triton import _fp8_gemv_kernel, launch_args

        amax_k = max(bk, min(triton.next_power_of_2(k), AMAX_ELEMENTS // bm))  # its tile: [BLOCK_M, AMAX_K]
        _fp8_gemv_kernel[(triton.cdiv(n, bn), dst.splits, triton.cdiv(m, bm))](
            x, w_q, w_s, dst.buf, m, n, k, dst.k_per_split, x.stride(0), x.stride(1), w_q.stride(0),
            w_q.stride(1), w_s.stride(0), w_s.stride(1), scs, scm, scn, GROUP_N=group_n, GROUP_K=group_k,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SCALE_AFTER=not w_per_tile, static_ptr=static,
            ACT=GEMV_ACT[act], AMAX_K=amax_k, **launch_args(plan), **pdl_kwargs(x))
        return dst.finish()
    # the interpreter has no fp8 dot; fp8 MMA instructions take K tiles of 32 and more
    upcast = x.device.type == "cpu" or bk < 32
    _fp8_w8a8_small_m_kernel[(triton.cdiv(n, bn), dst.splits, triton.cdiv(m, bm))](
        x, w_q, w_s, static, dst.buf, m, n, k, dst.k_per_split,
        x.stride(0), x.stride(1), w_q.stride(0), w_q.stride(1), w_s.stride(0), w_s.stride(1), scs, scm, scn,
        ACT=act, GROUP_N=group_n, GROUP_K=group_k if act == 2 or w_per_tile else 0, W_PER_TILE=w_per_tile,
        UPCAST_DOT=upcast, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, QUANT_ROWS=quant_rows, AMAX_K=amax_k,
        PROMOTE_K=min(PROMOTE_K, bk), **plan.launch_options(), **pdl_kwargs(x))
    return dst.finish()
