"""Triton GEMM over 4-bit weights: each K-tile of the packed weight is dequantized in registers.

y[m, n] = sum_k x[m, k] * (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n], with q unpacked from
`qweight` int32 [K / 8, N] (input k in bits 4 * (k % 8) of word k // 8). The full weight is never
materialized; each packed word is read once and unpacked to its 8 inputs in registers. Where inputs
sit in their groups in order (`group_size`: AWQ, GPTQ without desc_act) a K tile lies in one group, so
its scales and zeros are one row per tile: the tile multiplies (q - zero), exact in the activations'
dtype, and the scale multiplies the tile's float32 partial product. In bf16 / fp16 that tile comes from
integer operations and one packed subtraction: each nibble or-ed into the bits of OFFSET (128 / 1024),
then OFFSET + zero subtracted -- exact, as GPTQ's and AWQ's zeros are integers. Otherwise (desc_act) scales and
zeros are gathered per input through g_idx, so GPTQ's activation order needs no reordering. At decode
sizes the plan (`small_m_plan.int4_plan`) may split K (float32 partials, then `splitk_reduce`) or run
a GEMV kernel (`int4_gemv_triton`, or `int4_gemv_fold_triton` with the zero point folded out) instead,
so a decode step spreads each layer over all the SMs. Runs on CUDA; on the CPU only under
TRITON_INTERPRET=1 (tests, small shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from keel_quantization.pdl import pdl_enter, pdl_kwargs
from keel_quantization.small_m_plan import SmallMPlan, int4_plan
from keel_quantization.splitk_reduce import SplitKOutput, split_range


@triton.jit
def _int4_tile(qw_ptr, k0, k_end, offs_n, mask_n, stride_qk, stride_qn,
               BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Float32 4-bit values [BLOCK_K, BLOCK_N] of inputs k0 .. k0 + BLOCK_K (0 past k_end and N)."""
    words = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # K is a multiple of 8
    packed = tl.load(qw_ptr + words[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                     mask=(words[:, None] < k_end // 8) & mask_n[None, :], other=0)  # [BK / 8, BN] int32
    q = (packed[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF  # [BK / 8, 8, BN]: input 8 * word + nibble
    return tl.reshape(q, (BLOCK_K, BLOCK_N)).to(tl.float32)


@triton.jit
def _int4_tile_magic(qw_ptr, k0, k_end, offs_n, mask_n, stride_qk, stride_qn,
                     BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, MAGIC: tl.constexpr, dtype: tl.constexpr):
    """OFFSET + q [BLOCK_K, BLOCK_N] in `dtype` (bf16 / fp16) from integer operations alone: a nibble or-ed
    into the bits of OFFSET (MAGIC: bf16 128.0 = 0x4300 or fp16 1024.0 = 0x6400, whose units bit is the
    mantissa's lowest) is exactly OFFSET + q. Why: the float path (`_int4_tile` then a cast) costs an
    int-to-float and a float-to-bf16 conversion per weight element, on sm_90's 16-a-clock conversion pipe
    -- the GEMM's limit at M 16-512 -- where this costs a shift and one LOP3 (64 a clock)."""
    words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    packed = tl.load(qw_ptr + words[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                     mask=(words[:, None] < k_end // 8) & mask_n[None, :], other=0)  # [BK / 8, BN] int32
    bits = ((packed[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF) | MAGIC  # [BK / 8, 8, BN]
    return tl.reshape(bits.to(tl.int16).to(dtype, bitcast=True), (BLOCK_K, BLOCK_N))


@triton.jit
def _tile_group(s_ptr, z_ptr, k0, offs_n, mask_n, stride_sg, stride_sn, GROUP: tl.constexpr):
    """(scales, zeros) [BLOCK_N] float32 of the one group a tile starting at k0 lies in."""
    sz = (k0 // GROUP) * stride_sg + offs_n * stride_sn
    return (tl.load(s_ptr + sz, mask=mask_n, other=0.0).to(tl.float32),
            tl.load(z_ptr + sz, mask=mask_n, other=0.0).to(tl.float32))


@triton.jit
def _gathered_groups(s_ptr, z_ptr, g_ptr, offs_k, mask_k, offs_n, mask_n, stride_sg, stride_sn):
    """(scales, zeros) [BLOCK_K, BLOCK_N] float32 per input through g_idx (0 outside K / N)."""
    g = tl.load(g_ptr + offs_k, mask=mask_k, other=0)  # [BK]
    sz = g[:, None] * stride_sg + offs_n[None, :] * stride_sn
    mask_kn = mask_k[:, None] & mask_n[None, :]
    return (tl.load(s_ptr + sz, mask=mask_kn, other=0.0).to(tl.float32),
            tl.load(z_ptr + sz, mask=mask_kn, other=0.0).to(tl.float32))


@triton.jit
def _int4_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, y_ptr,
    M, N, K, K_PER_SPLIT,  # split s (program_id 2) covers inputs [s * K_PER_SPLIT, (s + 1) * K_PER_SPLIT)
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_ys, stride_ym, stride_yn,
    GROUP: tl.constexpr,  # > 0: input k is in group k // GROUP and BLOCK_K divides GROUP; 0: read g_idx
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
    MAGIC: tl.constexpr, OFFSET: tl.constexpr,  # bits and value of the float a nibble is or-ed into (0: float path)
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start, k_end = split_range(tl.program_id(2), K, K_PER_SPLIT)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        if GROUP > 0 and MAGIC != 0:  # in-order groups, bf16 / fp16 activations: no float conversion per weight
            w = _int4_tile_magic(qw_ptr, k0, k_end, offs_n, mask_n, stride_qk, stride_qn, BLOCK_K, BLOCK_N,
                                 MAGIC, x_ptr.dtype.element_ty)  # [BK, BN] = OFFSET + q, exact
            s, z = _tile_group(s_ptr, z_ptr, k0, offs_n, mask_n, stride_sg, stride_sn, GROUP)  # [BN]
            # (OFFSET + q) - (OFFSET + z) in the activations' dtype: exact for integer zeros (GPTQ, AWQ)
            w = w - (z + OFFSET).to(x_ptr.dtype.element_ty)[None, :]  # [BK, BN]
            part = tl.dot(x, w) * s[None, :]
        else:
            q = _int4_tile(qw_ptr, k0, k_end, offs_n, mask_n, stride_qk, stride_qn, BLOCK_K, BLOCK_N)  # [BK, BN]
            if GROUP > 0:
                s, z = _tile_group(s_ptr, z_ptr, k0, offs_n, mask_n, stride_sg, stride_sn, GROUP)  # [BN]
                w = q - z[None, :]  # [BK, BN] small integers: exact in any float dtype
            else:
                s, z = _gathered_groups(s_ptr, z_ptr, g_ptr, offs_k, mask_k, offs_n, mask_n, stride_sg, stride_sn)
                w = (q - z) * s  # [BK, BN], zero outside K / N
            if DOT_F32:
                part = tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                part = tl.dot(x, w.to(x.dtype))
            if GROUP > 0:
                part = part * s[None, :]
        acc += part
    y_ptr += tl.program_id(2) * stride_ys  # one split: y itself; more: this split's float32 partials
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# activation dtype -> (bits, value) of the float whose mantissa's lowest bit is 1: OFFSET + q for a nibble q
_MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


def int4_gemm(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # int32 [K / 8, N]
    scales: torch.Tensor,  # [groups, N]
    zeros: torch.Tensor,  # [groups, N], same dtype as scales; integers (GPTQ / AWQ) for bf16 / fp16 x
    g_idx: torch.Tensor,  # int32 [K]
    out: torch.Tensor | None = None,  # [M, N] in x's dtype, written in full
    group_size: int = 0,  # > 0: g_idx is k // group_size (inputs in order; a power of two >= 8, or K)
    tiles: tuple[int, int, int] | None = None,  # (BLOCK_M, BLOCK_N, BLOCK_K) of the dot kernel; tests pick small ones
    plan: SmallMPlan | None = None,  # kernel, tiles, K split; default small_m_plan.int4_plan (per shape)
) -> torch.Tensor:  # [M, N] in x's dtype
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * 8 != k or g_idx.shape != (k,) or scales.shape != zeros.shape or scales.shape[1] != n:
        raise ValueError(f"int4_gemm: shapes do not fit: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, "
                         f"scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)}, g_idx {tuple(g_idx.shape)}")
    group = min(group_size, k)
    if plan is None:
        plan = SmallMPlan("dot", *tiles) if tiles else int4_plan(m, n, k, group)
    bm, bn, bk = plan.block_m, plan.block_n, plan.block_k
    if not plan.fits_groups(group if group < k else 0) or bk % 8:
        raise ValueError(f"int4_gemm: BLOCK_K {bk} must be a multiple of 8 dividing the group size {group}"
                         + (" or, for gemv_fold, a multiple of it" if plan.kernel == "gemv_fold" else ""))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return y
    dst = SplitKOutput(y, k, bk, plan.split_k)
    args = (x, qweight, scales, zeros, g_idx, dst.buf, m, n, k, dst.k_per_split, x.stride(0), x.stride(1),
            qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1), *dst.strides)
    gemv_grid = (triton.cdiv(n, bn), dst.splits, triton.cdiv(m, bm))
    if plan.kernel == "gemv":
        from keel_quantization.int4_gemv_triton import _int4_gemv_kernel

        _int4_gemv_kernel[gemv_grid](*args, GROUP=group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **plan.launch_options(),
                                     **pdl_kwargs(x))
    elif plan.kernel == "gemv_fold":
        from keel_quantization.int4_gemv_fold_triton import _int4_gemv_fold_kernel

        _int4_gemv_fold_kernel[gemv_grid](*args, GROUP=group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                          EVEN=k % bk == 0 and n % bn == 0, STAGES=plan.num_stages or 1,
                                          **plan.launch_options(), **pdl_kwargs(x))
    else:
        _int4_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), dst.splits)](
            *args, GROUP=group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=x.dtype == torch.float32,
            MAGIC=_MAGIC.get(x.dtype, (0, 0.0))[0], OFFSET=_MAGIC.get(x.dtype, (0, 0.0))[1], **plan.launch_options(),
            **pdl_kwargs(x))
    return dst.finish()
