"""Triton GEMM over 4-bit weights: each K-tile of the packed weight is dequantized in registers.

y[m, n] = sum_k x[m, k] * (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n], with q unpacked from
`qweight` int32 [K / 8, N] (input k in bits 4 * (k % 8) of word k // 8). The full weight is never
materialized; each packed word is read once and unpacked to its 8 inputs in registers. Where inputs
sit in their groups in order (`group_size`: AWQ, GPTQ without desc_act) a K tile lies in one group, so
its scales and zeros are one row per tile: the tile multiplies (q - zero), exact in the activations'
dtype, and the scale multiplies the tile's float32 partial product. Otherwise (desc_act) scales and
zeros are gathered per input through g_idx, so GPTQ's activation order needs no reordering. Tiles are
narrow in N for small M, so a decode step spreads each layer over all the SMs. Runs on CUDA; on the
CPU only under TRITON_INTERPRET=1 (tests, small shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_ym, stride_yn,
    GROUP: tl.constexpr,  # > 0: input k is in group k // GROUP and BLOCK_K divides GROUP; 0: read g_idx
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_w = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        words = k0 // 8 + offs_w  # K is a multiple of 8
        packed = tl.load(qw_ptr + words[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                         mask=(words[:, None] < K // 8) & mask_n[None, :], other=0)  # [BK / 8, BN] int32
        q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [BK / 8, 8, BN]: input 8 * word + nibble
        q = tl.reshape(q, (BLOCK_K, BLOCK_N)).to(tl.float32)
        if GROUP > 0:
            sz = (k0 // GROUP) * stride_sg + offs_n * stride_sn  # [BN]: the tile's one group
            s = tl.load(s_ptr + sz, mask=mask_n, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + sz, mask=mask_n, other=0.0).to(tl.float32)
            w = q - z[None, :]  # [BK, BN] small integers: exact in any float dtype
        else:
            g = tl.load(g_ptr + offs_k, mask=mask_k, other=0)  # [BK]
            sz = g[:, None] * stride_sg + offs_n[None, :] * stride_sn
            mask_kn = mask_k[:, None] & mask_n[None, :]
            s = tl.load(s_ptr + sz, mask=mask_kn, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + sz, mask=mask_kn, other=0.0).to(tl.float32)
            w = (q - z) * s  # [BK, BN], zero outside K / N
        if DOT_F32:
            part = tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            part = tl.dot(x, w.to(x.dtype))
        if GROUP > 0:
            part = part * s[None, :]
        acc += part
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _tiles(m: int, group: int) -> tuple[int, int, int]:
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 32 if m <= 32 else 64  # small M: 128 programs for a 4096-output layer
    block_k = 128 if group == 0 else min(128, group)
    return block_m, block_n, block_k


def int4_gemm(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # int32 [K / 8, N]
    scales: torch.Tensor,  # [groups, N]
    zeros: torch.Tensor,  # [groups, N], same dtype as scales
    g_idx: torch.Tensor,  # int32 [K]
    out: torch.Tensor | None = None,  # [M, N] in x's dtype, written in full
    group_size: int = 0,  # > 0: g_idx is k // group_size (inputs in order; a power of two >= 8, or K)
    tiles: tuple[int, int, int] | None = None,  # (BLOCK_M, BLOCK_N, BLOCK_K); tests pick small ones
) -> torch.Tensor:  # [M, N] in x's dtype
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * 8 != k or g_idx.shape != (k,) or scales.shape != zeros.shape or scales.shape[1] != n:
        raise ValueError(f"int4_gemm: shapes do not fit: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, "
                         f"scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)}, g_idx {tuple(g_idx.shape)}")
    group = min(group_size, k)
    block_m, block_n, block_k = tiles or _tiles(m, group)
    if group and group < k and group % block_k:
        raise ValueError(f"int4_gemm: BLOCK_K {block_k} must divide the group size {group}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return y
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](
        x, qweight, scales, zeros, g_idx, y, m, n, k,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        y.stride(0), y.stride(1),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_F32=x.dtype == torch.float32,
    )
    return y
