"""The int4 weight dequantized in full, for GEMMs of `int4_linear.DEQUANT_GEMM_MIN_M` (256) tokens or more --
prefill chunks, and decode steps of a full batch: w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]
(g = g_idx[k], or k // GROUP where inputs are in group order), written in the activations' dtype, then one
cuBLAS GEMM (`int4_linear`). There cuBLAS's bf16 rate beats a Triton GEMM that dequantizes every tile in
registers by more than the extra traffic costs (int4 read, bf16 written and read back: ~4.5 bytes a
weight; a few percent of the GEMM at thousands of tokens). Smaller steps never take this path: there the
weight's bytes are the cost, and the in-GEMM kernels read 0.5 bytes a weight.

Each program writes a [BLOCK_K, BLOCK_N] tile from [BLOCK_K / 8, BLOCK_N] packed words, storing each
nibble plane straight to its rows (input 8 * word + nibble): no register reshape. Rounding: (q - z) * s in
float32, rounded once to the output dtype -- bit-equal to `int4_math.dequantize_int4` in that dtype (the
product of a small integer and a bf16 / fp16 scale is exact in float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64  # inputs a tile: 8 packed word rows
BLOCK_N = 128


@triton.jit
def _int4_dequant_kernel(
    qw_ptr, s_ptr, z_ptr, g_ptr, w_ptr,  # w: [K, N] out
    N, K, stride_qk, stride_sg, stride_wk,
    GROUP: tl.constexpr,  # > 0: input k is in group k // GROUP; 0: read g_idx
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    words = tl.program_id(0) * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)  # [BK / 8]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nib = tl.arange(0, 8)
    k = words[:, None, None] * 8 + nib[None, :, None]  # [BK / 8, 8, 1] input index
    mask_w = (words[:, None] < K // 8) & (offs_n[None, :] < N)  # [BK / 8, BN]; K is a multiple of 8
    mask = (k < K) & (offs_n[None, None, :] < N)  # [BK / 8, 8, BN]
    packed = tl.load(qw_ptr + words[:, None] * stride_qk + offs_n[None, :], mask=mask_w, other=0)
    q = ((packed[:, None, :] >> (nib * 4)[None, :, None]) & 0xF).to(tl.float32)  # [BK / 8, 8, BN]
    if GROUP > 0:
        g = k // GROUP
    else:
        g = tl.load(g_ptr + k, mask=k < K, other=0)
    sz = g * stride_sg + offs_n[None, None, :]
    s = tl.load(s_ptr + sz, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + sz, mask=mask, other=0.0).to(tl.float32)
    tl.store(w_ptr + k * stride_wk + offs_n[None, None, :], ((q - z) * s).to(w_ptr.dtype.element_ty), mask=mask)


def int4_dequantize(
    qweight: torch.Tensor,  # int32 [K / 8, N]
    scales: torch.Tensor,  # [groups, N]
    zeros: torch.Tensor,  # [groups, N], same dtype as scales
    g_idx: torch.Tensor,  # int32 [K]
    dtype: torch.dtype,
    group_size: int = 0,  # > 0: g_idx is k // group_size (int4_linear.tileable_group)
    out: torch.Tensor | None = None,  # [K, N] in dtype, written in full
) -> torch.Tensor:  # [K, N] in dtype
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if g_idx.shape != (k,) or scales.shape != zeros.shape or scales.shape[1] != n:
        raise ValueError(f"int4_dequantize: shapes do not fit: qweight {tuple(qweight.shape)}, scales "
                         f"{tuple(scales.shape)}, zeros {tuple(zeros.shape)}, g_idx {tuple(g_idx.shape)}")
    if qweight.stride(1) != 1 or scales.stride(1) != 1 or zeros.stride() != scales.stride():
        raise ValueError("int4_dequantize: qweight, scales and zeros need contiguous rows and equal strides")
    w = torch.empty(k, n, dtype=dtype, device=qweight.device) if out is None else out
    if w.shape != (k, n) or w.dtype != dtype or w.stride(1) != 1:
        raise ValueError(f"int4_dequantize: out must be [{k}, {n}] {dtype} with contiguous rows")
    grid = (triton.cdiv(k, BLOCK_K), triton.cdiv(n, BLOCK_N))
    _int4_dequant_kernel[grid](qweight, scales, zeros, g_idx, w, n, k, qweight.stride(0), scales.stride(0),
                               w.stride(0), GROUP=min(group_size, k), BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N)
    return w
