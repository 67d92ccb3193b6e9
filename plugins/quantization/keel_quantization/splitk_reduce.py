"""The sum of a split-K GEMM: y = sum over splits of the float32 partials, cast to y's dtype.

The GEMM kernels write each split's partial product in full into `workspace` [splits, M, N] (float32), and the
splits are summed in split order, so the result does not depend on scheduling. Two ways:
- a second launch (`splitk_reduce`), nothing to zero;
- in the GEMM's own launch (`store_tile`): the program that finishes a tile's last split, counted in the core's
  per-device counters (`keel.kernel_counts`; the count returns to 0 as the tile's sum is written, so a CUDA graph
  replays it as is), sums the tile's partials. The same numbers without a launch: at batch 1 every decode GEMM
  of a split plan paid one (128 a Llama-8B step, `_splitk_reduce_kernel`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from keel.kernel_counts import kernel_counts
from keel_quantization.pdl import pdl_enter, pdl_kwargs


@triton.jit
def split_range(split, K, K_PER_SPLIT):
    """Inputs [start, end) of K split `split` (a program id) in the GEMM kernels."""
    k_start = split * K_PER_SPLIT
    return k_start, tl.minimum(K, k_start + K_PER_SPLIT)


@triton.jit
def store_tile(acc, c_ptr, c_offs, y_ptr, y_offs, mask, stride_cs, count_ptr):
    """A split GEMM program's result, acc (float32): this split's partial over the tile at c_offs (within one
    split's partials) / y_offs (within y), mask the tile's live elements; the grid is (N tiles, splits, M tiles).
    One split: y. More: the partial goes to the workspace (c_ptr, a split every stride_cs), and the tile's last
    split to finish sums every split's partial in split order (`_splitk_reduce_kernel`'s numbers) into y."""
    splits = tl.num_programs(1)
    if splits == 1:
        tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(c_ptr + tl.program_id(1) * stride_cs + c_offs, acc, mask=mask)
        # every thread's partial is written before the count moves; the count's release / acquire makes the
        # partials of the programs counted before visible to the last (CUTLASS's semaphore: barrier, one thread's
        # release; acquire, barrier)
        tl.debug_barrier()
        tile = tl.program_id(0) + tl.program_id(2) * tl.num_programs(0)
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == splits - 1:
            tl.debug_barrier()
            total = tl.zeros_like(acc)
            for s in range(splits):  # from L2 (.cg): the other programs' partials never were in this SM's L1
                total += tl.load(c_ptr + s * stride_cs + c_offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + y_offs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch


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
    `finish` reduces into y -- or, for a kernel that sums in its own launch (`store_tile`) over `out_tiles` output
    tiles, given y and `counts`, nothing left to do. `strides` are (split, m, n) for the kernel's output pointer."""

    def __init__(self, y: torch.Tensor, k: int, block_k: int, split_k: int, out_tiles: int = 0) -> None:
        k_tiles = -(-k // block_k)  # y: [M, N]; out_tiles 0: the kernel leaves the sum to `finish`'s launch
        self.k_per_split = -(-k_tiles // split_k) * block_k  # a multiple of BLOCK_K: tiles stay on the group grid
        self.splits = max(1, -(-k // self.k_per_split))
        self.y = y
        m, n = y.shape
        self.buf = y if self.splits == 1 else splitk_workspace(self.splits, m, n, y.device)
        self.strides = ((0, y.stride(0), y.stride(1)) if self.splits == 1
                        else (self.buf.stride(0), self.buf.stride(1), self.buf.stride(2)))
        self.counts = kernel_counts(y.device, out_tiles) if out_tiles else None  # one per output tile

    def finish(self) -> torch.Tensor:  # [M, N]
        return self.y if self.splits == 1 or self.counts is not None else splitk_reduce(self.buf, self.y)
