"""The second launch of a split-K GEMM: y = sum over splits of the float32 partials, cast to y's dtype.

The GEMM kernels write each split's partial product in full into `workspace` [splits, M, N] (float32), so
nothing needs zeroing and a CUDA graph captures the pair as is; the splits are summed in order, so the
result does not depend on scheduling (no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from keel_quantization.pdl import pdl_enter, pdl_kwargs


@triton.jit
def split_range(split, K, K_PER_SPLIT):
    """Inputs [start, end) of K split `split` (a program id) in the GEMM kernels."""
    k_start = split * K_PER_SPLIT
    return k_start, tl.minimum(K, k_start + K_PER_SPLIT)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, y_ptr, M, N, SPLITS, stride_ws, stride_wm, stride_ym, stride_yn,
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    m = offs // N
    n = offs % N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(ws_ptr + s * stride_ws + m * stride_wm + n, mask=mask, other=0.0)
    tl.store(y_ptr + m * stride_ym + n * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=mask)


def splitk_workspace(splits: int, m: int, n: int, device: torch.device) -> torch.Tensor:
    """Float32 partials [splits, M, N]; each split's slice is written in full by the GEMM."""
    return torch.empty(splits, m, n, dtype=torch.float32, device=device)


def splitk_reduce(
    workspace: torch.Tensor,  # float32 [splits, M, N], contiguous in N
    y: torch.Tensor,  # [M, N], written in full
) -> torch.Tensor:
    splits, m, n = workspace.shape
    block = 1024
    _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
        workspace, y, m, n, splits, workspace.stride(0), workspace.stride(1), y.stride(0), y.stride(1), BLOCK=block,
        **pdl_kwargs(workspace))
    return y


class SplitKOutput:
    """Where a (possibly split) GEMM launch writes: y itself for one split, else a fresh workspace that
    `finish` reduces into y. `strides` are (split, m, n) for the kernel's output pointer."""

    def __init__(self, y: torch.Tensor, k: int, block_k: int, split_k: int) -> None:  # y: [M, N]
        tiles = -(-k // block_k)
        self.k_per_split = -(-tiles // split_k) * block_k  # a multiple of BLOCK_K: tiles stay on the group grid
        self.splits = max(1, -(-k // self.k_per_split))
        self.y = y
        m, n = y.shape
        self.buf = y if self.splits == 1 else splitk_workspace(self.splits, m, n, y.device)
        self.strides = ((0, y.stride(0), y.stride(1)) if self.splits == 1
                        else (self.buf.stride(0), self.buf.stride(1), self.buf.stride(2)))

    def finish(self) -> torch.Tensor:  # [M, N]
        return self.y if self.splits == 1 else splitk_reduce(self.buf, self.y)
