"""The int4 weight dequantized in full, for GEMMs of `int4_linear.DEQUANT_GEMM_MIN_M` (256) tokens or more --
prefill chunks, and decode steps of a full batch: w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]
(g = g_idx[k], or k // GROUP where inputs are in group order), written in the activations' dtype, then one
cuBLAS GEMM (`int4_linear`). There cuBLAS's bf16 rate beats a Triton GEMM that dequantizes every tile in
registers by more than the extra traffic costs (int4 read, bf16 written and read back: ~4.5 bytes a
weight; a few percent of the GEMM at thousands of tokens). Smaller steps never take this path: there the
weight's bytes are the cost, and the in-GEMM kernels read 0.5 bytes a weight.

Each program writes a [BLOCK_K, BLOCK_N] tile from [BLOCK_K / 8, BLOCK_N] packed words, one nibble plane
(inputs 8 * word + j) at a time, straight to its rows. Per weight element: a shift, one mask-or that puts
the nibble in the mantissa of 2^23 (the float 2^23 + q, exact: no int -> float conversion, which runs on
sm_90's 16-a-clock pipe), one subtract of 2^23 + z and one multiply by s. Scales and zeros are loaded once
a tile where the tile lies in one group (GROUP >= BLOCK_K), once a word row where groups are smaller, per
input only for a desc_act g_idx. Rounding: (q - z) * s in float32, rounded once to the output dtype --
bit-equal to `int4_math.dequantize_int4` in that dtype ((2^23 + q) - (2^23 + z) is q - z exactly for
integer zeros, and the product of a small integer and a bf16 / fp16 scale is exact in float32).

Predicted from h200-int4-prefill-4083418.json, where the earlier kernel (scales loaded per element, an int ->
float conversion per element, 64 x 128 tiles) took ~270 us for Llama-8B's four layers (2.06x the ~130 us of
int4 read + bf16 written at copy bandwidth): ~160 us, ~3.5 ms off a GPTQ step of 256 tokens or more.
Measured (h200-int4-dequant-2328ea6.json, calls back to back over outputs past the L2): the earlier kernel
180 us (1.39x the floor; the 270 was single-call timing), this one 169.5 us (1.31x; a bf16 copy of the same
bytes 138 us), every tile of the sweep within 1.3-1.5x: the pass is near streaming speed, and GPTQ's
throughput rose 1-2% (11.4k -> 11.6k out tok/s).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from keel_quantization.pdl import pdl_enter, pdl_kwargs

_TWO_23 = tl.constexpr(8388608.0)


@dataclass(frozen=True)
class DequantTile:
    block_k: int = 128  # inputs a tile (a multiple of 8: BLOCK_K / 8 packed word rows)
    block_n: int = 128
    num_warps: int = 4


DEFAULT_TILE = DequantTile()


@triton.jit
def dequant_plane(packed, j: tl.constexpr, zb, s):
    """(q - z) * s in float32 for nibble j of each packed word: the nibble or-ed into the mantissa of 2^23 is
    the float 2^23 + q exactly; zb = 2^23 + z, s in float32 (shaped to broadcast against `packed`)."""
    q = (((packed >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + q
    return (q - zb) * s


@triton.jit
def _int4_dequant_kernel(
    qw_ptr, s_ptr, z_ptr, g_ptr, w_ptr,  # w: [K, N] out
    N, K, stride_qk, stride_sg, stride_wk,
    GROUP: tl.constexpr,  # > 0: input k is in group k // GROUP (a power of two from 8, or K); 0: read g_idx
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid_k = tl.program_id(0)
    words = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)  # [BK / 8]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_w = (words < K // 8)[:, None] & (offs_n < N)[None, :]  # [BK / 8, BN]; K is a multiple of 8
    packed = tl.load(qw_ptr + words[:, None] * stride_qk + offs_n[None, :], mask=mask_w, other=0)
    if GROUP >= BLOCK_K:  # the tile lies in one group (GROUP a multiple of BLOCK_K, or one group over K)
        sz = ((pid_k * BLOCK_K) // GROUP) * stride_sg + offs_n[None, :]  # [1, BN]
        mask_sz = (offs_n < N)[None, :]
    elif GROUP > 0:  # a group per word row or more
        sz = ((8 * words) // GROUP)[:, None] * stride_sg + offs_n[None, :]  # [BK / 8, BN]
        mask_sz = mask_w
    if GROUP > 0:
        s = tl.load(s_ptr + sz, mask=mask_sz, other=0.0).to(tl.float32)
        zb = tl.load(z_ptr + sz, mask=mask_sz, other=0.0).to(tl.float32) + _TWO_23  # 2^23 + z, exact
    for j in tl.static_range(8):
        k = 8 * words + j  # [BK / 8] this plane's inputs
        if GROUP == 0:
            g = tl.load(g_ptr + k, mask=k < K, other=0)
            sz = g[:, None] * stride_sg + offs_n[None, :]
            s = tl.load(s_ptr + sz, mask=mask_w, other=0.0).to(tl.float32)
            zb = tl.load(z_ptr + sz, mask=mask_w, other=0.0).to(tl.float32) + _TWO_23
        w = dequant_plane(packed, j, zb, s)
        tl.store(w_ptr + k[:, None] * stride_wk + offs_n[None, :], w.to(w_ptr.dtype.element_ty), mask=mask_w)


def int4_dequantize(
    qweight: torch.Tensor,  # int32 [K / 8, N]
    scales: torch.Tensor,  # [groups, N]
    zeros: torch.Tensor,  # [groups, N], same dtype as scales
    g_idx: torch.Tensor,  # int32 [K]
    dtype: torch.dtype,
    group_size: int = 0,  # > 0: g_idx is k // group_size (int4_linear.tileable_group)
    out: torch.Tensor | None = None,  # [K, N] in dtype, written in full
    tile: DequantTile = DEFAULT_TILE,  # benchmarks sweep others
) -> torch.Tensor:  # [K, N] in dtype
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if g_idx.shape != (k,) or scales.shape != zeros.shape or scales.shape[1] != n:
        raise ValueError(f"int4_dequantize: shapes do not fit: qweight {tuple(qweight.shape)}, scales "
                         f"{tuple(scales.shape)}, zeros {tuple(zeros.shape)}, g_idx {tuple(g_idx.shape)}")
    if qweight.stride(1) != 1 or scales.stride(1) != 1 or zeros.stride() != scales.stride():
        raise ValueError("int4_dequantize: qweight, scales and zeros need contiguous rows and equal strides")
    if tile.block_k % 8 or tile.block_k & (tile.block_k - 1):
        raise ValueError(f"int4_dequantize: tile.block_k must be a power of two from 8, got {tile.block_k}")
    w = torch.empty(k, n, dtype=dtype, device=qweight.device) if out is None else out
    if w.shape != (k, n) or w.dtype != dtype or w.stride(1) != 1:
        raise ValueError(f"int4_dequantize: out must be [{k}, {n}] {dtype} with contiguous rows")
    grid = (triton.cdiv(k, tile.block_k), triton.cdiv(n, tile.block_n))
    _int4_dequant_kernel[grid](qweight, scales, zeros, g_idx, w, n, k, qweight.stride(0), scales.stride(0),
                               w.stride(0), GROUP=min(group_size, k), BLOCK_K=tile.block_k, BLOCK_N=tile.block_n,
                               num_warps=tile.num_warps, **pdl_kwargs(qweight))
    return w
