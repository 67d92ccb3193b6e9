"""Triton W8A8 FP8 GEMM with per-group scales: y = sum over K groups of (a_q @ b_q^T) * a_s * b_s.

`fp8_gemm(a_q, a_s, b_q, b_s, group_n, group_k)`: a_q e4m3 [M, K] with float32 scales a_s [M, ceil(K / gk)]
(activations quantized per token and gk-input group), b_q e4m3 [N, K] with b_s [ceil(N / gn), ceil(K / gk)].
One shape serves every FP8 layout: block FP8 (DeepSeek-V3 / vLLM's w8a8_block_fp8_matmul: gn = gk = 128)
and per-channel weights with per-token activations (gn = 1, gk = K: one group). Each K tile lies in one
scale group (BLOCK_K divides gk, or gk = K), so the fp8 MMA runs on raw tiles and the scales multiply
the tile's float32 partial product. Only loads touch fp8 (Triton's CPU interpreter rounds fp8 casts
wrongly, loads exactly), so the interpreted kernel is checked against the reference on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_asm, stride_ask, stride_bn, stride_bk, stride_bsn, stride_bsk,
    stride_cm, stride_cn,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK] fp8
        b = tl.load(b_ptr + offs_n[None, :] * stride_bn + k[:, None] * stride_bk,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BK, BN] fp8
        g = k0 // GROUP_K
        a_s = tl.load(as_ptr + offs_m * stride_asm + g * stride_ask, mask=mask_m, other=0.0)  # [BM]
        b_s = tl.load(bs_ptr + (offs_n // GROUP_N) * stride_bsn + g * stride_bsk, mask=mask_n, other=0.0)  # [BN]
        if UPCAST_DOT:  # the interpreter has no fp8 dot: the same products in float32
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        acc += part * a_s[:, None] * b_s[None, :]
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _tiles(m: int, group_k: int, k: int) -> tuple[int, int, int]:
    block_k = 128 if group_k >= k else min(128, group_k)
    if m <= 16:
        return 16, 64, block_k
    return (32, 64, block_k) if m <= 64 else (64, 128, block_k)


def fp8_gemm(
    a_q: torch.Tensor,  # e4m3 [M, K]
    a_s: torch.Tensor,  # float32 [M, ceil(K / group_k)]
    b_q: torch.Tensor,  # e4m3 [N, K]
    b_s: torch.Tensor,  # float32 [ceil(N / group_n), ceil(K / group_k)]
    group_n: int,
    group_k: int,
    out_dtype: torch.dtype,
    tiles: tuple[int, int, int] | None = None,  # (BLOCK_M, BLOCK_N, BLOCK_K); tests pick small ones
    out: torch.Tensor | None = None,  # [M, N] in out_dtype, written in full
) -> torch.Tensor:  # [M, N]
    m, k = a_q.shape
    n = b_q.shape[0]
    if b_q.shape[1] != k or a_s.shape[0] != m or b_s.shape[0] != -(-n // group_n) or b_s.shape[1] != a_s.shape[1]:
        raise ValueError(f"fp8_gemm: shapes do not fit: a {tuple(a_q.shape)}, a_s {tuple(a_s.shape)}, b "
                         f"{tuple(b_q.shape)}, b_s {tuple(b_s.shape)}, groups ({group_n}, {group_k})")
    bm, bn, bk = tiles or _tiles(m, group_k, k)
    if group_k < k and group_k % bk:
        raise ValueError(f"fp8_gemm: BLOCK_K {bk} must divide the scale group {group_k}")
    y = torch.empty(m, n, dtype=out_dtype, device=a_q.device) if out is None else out
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _fp8_gemm_kernel[grid](
        a_q, a_s, b_q, b_s, y, m, n, k,
        a_q.stride(0), a_q.stride(1), a_s.stride(0), a_s.stride(1), b_q.stride(0), b_q.stride(1),
        b_s.stride(0), b_s.stride(1), y.stride(0), y.stride(1),
        GROUP_N=group_n, GROUP_K=group_k,
        # the interpreter has no fp8 dot; fp8 MMA instructions take K tiles of 32 and more
        UPCAST_DOT=a_q.device.type == "cpu" or bk < 32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
    )
    return y
