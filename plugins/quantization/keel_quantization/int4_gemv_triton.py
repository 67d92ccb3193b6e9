"""Int4 GEMV for a few rows (decode at M <= 4-8): packed words dequantized in registers, no tensor cores.

The same math and layout as `int4_triton` (qweight int32 [K / 8, N], input k in bits 4 * (k % 8) of word
k // 8; zeros and scales per group, in order (GROUP > 0: one row per tile) or gathered through g_idx). A
program owns BLOCK_N outputs of one K split and every M row (BLOCK_M >= M): each step loads
[BLOCK_K / 8, BLOCK_N] words (contiguous along N), unpacks them to [BLOCK_K, BLOCK_N] and multiply-adds
them (dequantized: (q - zero) * scale) with the activations in float32; the products sum over K once,
after the loop. The grid is (N / BLOCK_N, splits, M / BLOCK_M) and writes y (one split) or the float32
partials `splitk_reduce` sums.
Launched through `int4_triton.int4_gemm` with a "gemv" `SmallMPlan`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from keel_quantization.int4_triton import _gathered_groups, _int4_tile, _tile_group
from keel_quantization.splitk_reduce import split_range


@triton.jit
def _int4_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, y_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_ys, stride_ym, stride_yn,
    GROUP: tl.constexpr,  # > 0: input k is in group k // GROUP and BLOCK_K divides GROUP; 0: read g_idx
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_s = tl.program_id(1)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start, k_end = split_range(pid_s, K, K_PER_SPLIT)
    # products accumulate elementwise and are summed over K once after the loop: no cross-thread
    # reduction per tile (one M row: a 2-D accumulator)
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_K, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        q = _int4_tile(qw_ptr, k0, k_end, offs_n, mask_n, stride_qk, stride_qn, BLOCK_K, BLOCK_N)  # [BK, BN]
        if GROUP > 0:
            s, z = _tile_group(s_ptr, z_ptr, k0, offs_n, mask_n, stride_sg, stride_sn, GROUP)  # [BN]
            w = (q - z[None, :]) * s[None, :]  # [BK, BN]
        else:
            s, z = _gathered_groups(s_ptr, z_ptr, g_ptr, offs_k, mask_k, offs_n, mask_n, stride_sg, stride_sn)
            w = (q - z) * s  # [BK, BN], zero outside K / N
        if BLOCK_M == 1:
            x = tl.load(x_ptr + offs_m * stride_xm + offs_k * stride_xk, mask=mask_m & mask_k, other=0.0)  # [BK]
            acc += x.to(tl.float32)[:, None] * w
        else:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)  # [BM, BK]
            acc += x[:, :, None] * w[None, :, :]
    if BLOCK_M == 1:
        out = tl.sum(acc, axis=0)[None, :]  # [1, BN]
    else:
        out = tl.sum(acc, axis=1)  # [BM, BN]
    y_ptr += pid_s * stride_ys
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
             out.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
