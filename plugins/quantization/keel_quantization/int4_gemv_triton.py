"""Int4 GEMV for a few rows (decode at M <= 4-8): packed words dequantized in registers, no tensor cores.

The same math and layout as `int4_triton` (qweight int32 [K / 8, N], input k in bits 4 * (k % 8) of word
k // 8; zeros and scales per group, in order (GROUP > 0: one row per tile) or gathered through g_idx). A
program owns BLOCK_N outputs of one K split and every M row (BLOCK_M >= M): each step loads
[BLOCK_K / 8, BLOCK_N] words (contiguous along N) and, per nibble j (inputs 8 * word + j), turns them into
floats without an int -> float conversion (the nibble in the mantissa of 2^23), dequantizes ((q - zero) *
scale) and multiply-adds them with the activations in float32 -- no [BLOCK_K, BLOCK_N] reshape of the
unpacked tile. The products sum over K once, after the loop. The grid is (N / BLOCK_N, splits,
M / BLOCK_M) and writes y (one split) or the float32 partials `splitk_reduce` sums. Launched through
`int4_triton.int4_gemm` with a "gemv" `SmallMPlan`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from keel_quantization.pdl import pdl_enter
from keel_quantization.splitk_reduce import split_range


@triton.jit
def _int4_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, y_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_ys, stride_ym, stride_yn,
    GROUP: tl.constexpr,  # > 0: input k is in group k // GROUP and BLOCK_K divides GROUP; 0: read g_idx
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid_s = tl.program_id(1)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start, k_end = split_range(pid_s, K, K_PER_SPLIT)
    offs_w = tl.arange(0, BLOCK_K // 8)
    # products accumulate elementwise and are summed over K once after the loop: no cross-thread
    # reduction per tile
    acc = tl.zeros((BLOCK_M, BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        words = k0 // 8 + offs_w  # [BK / 8]
        mask_w = words < k_end // 8
        packed = tl.load(qw_ptr + words[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                         mask=mask_w[:, None] & mask_n[None, :], other=0)  # [BK / 8, BN] int32
        if GROUP > 0:
            sz = (k0 // GROUP) * stride_sg + offs_n * stride_sn
            s = tl.load(s_ptr + sz, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            z = tl.load(z_ptr + sz, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        for j in tl.static_range(8):
            # nibble j of each word is input 8 * word + j: or-ed into the mantissa of 2^23 it is the float
            # 2^23 + q exactly (no int -> float conversion, the unpack's bottleneck)
            bits = ((packed >> (4 * j)) & 0xF) | 0x4B000000
            q = bits.to(tl.float32, bitcast=True) - 8388608.0  # [BK / 8, BN]: q, exactly
            k = 8 * words + j
            if GROUP == 0:
                g = tl.load(g_ptr + k, mask=mask_w, other=0)
                sz = g[:, None] * stride_sg + offs_n[None, :] * stride_sn
                mkn = mask_w[:, None] & mask_n[None, :]
                s = tl.load(s_ptr + sz, mask=mkn, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + sz, mask=mkn, other=0.0).to(tl.float32)
            w = (q - z) * s  # [BK / 8, BN]
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                        mask=mask_m[:, None] & mask_w[None, :], other=0.0).to(tl.float32)  # [BM, BK / 8]
            acc += x[:, :, None] * w[None, :, :]
    out = tl.sum(acc, axis=1)  # [BM, BN]
    y_ptr += pid_s * stride_ys
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
             out.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
