"""The sum of a split-K GEMM's partials: y = sum over splits of the float32 partials, cast to y's dtype.

The GEMM kernels write each split's partial product in full into `workspace` [splits, M, N] (float32), so
nothing needs zeroing and a CUDA graph captures them as is; the splits are summed in order, so the result does
not depend on scheduling. Two forms, bit-equal:
- a second launch, `splitk_reduce` (`SplitKOutput.finish`);
- serial (`SplitKOutput(serial=True)`, kernels calling `store_split` with SERIAL): the program that finishes a
  tile's last split sums the tile's partials and stores y -- CUTLASS's serial split-K / a semaphore per output
  tile. Each tile's counter (int32, `tile_counters`) counts the splits that stored, and the summing program
  sets it back to 0, so the counters are zero between launches and graph replays reuse them. Why: at batch 1
  every quantized layer's split GEMM paid a reduce launch (Llama-8B fp8: 128 a step, 0.27 ms of 4.29 on an H100
  without PDL, aca32ad's profile).
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


@triton.jit
def store_split(acc, c_ptr, c_off, stride_cs, y_ptr, y_off, mask, cnt_ptr, SERIAL: tl.constexpr):
    """The store at the end of a split-K GEMM program (its split is program_id(1)): `acc` (float32) at `c_ptr +
    split * stride_cs + c_off` -- y itself for one split, else the workspace; SERIAL: then, in the program that
    stores the tile's last split (`cnt_ptr`: the tile's counter), the splits' sum in order into `y_ptr + y_off`."""
    split = tl.program_id(1)
    if SERIAL:
        tl.store(c_ptr + split * stride_cs + c_off, acc, mask=mask)
        # every thread's partial is issued before the counter moves (the acq_rel add releases what the barrier
        # ordered, as CUTLASS's semaphore: bar.sync, then one thread's gpu-scope release)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) - 1:
            total = tl.zeros_like(acc)
            for s in range(tl.num_programs(1)):  # splitk_reduce's order: bit-equal to the second launch
                total += tl.load(c_ptr + s * stride_cs + c_off, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + y_off, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")  # zero again for the next launch
    else:
        tl.store(c_ptr + split * stride_cs + c_off, acc.to(c_ptr.dtype.element_ty), mask=mask)


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}
MIN_COUNTERS = 16384  # Llama-8B's widest quantized layer (gate_up, N 28672) at BLOCK_N 64 takes 448


def tile_counters(device: torch.device, count: int) -> torch.Tensor:
    """int32 zeros, >= `count`, for serial split-K launches on the current stream of `device`: kernels leave
    them zero, and launches on one stream never overlap (a PDL launch waits for the previous kernel before it
    touches memory), while another stream (a graph's side stream) gets its own."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    found = _COUNTERS.get((device, stream))
    if found is None or found.numel() < count:
        found = _COUNTERS[(device, stream)] = torch.zeros(max(count, MIN_COUNTERS), dtype=torch.int32, device=device)
    return found


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
    `finish` reduces into y -- or, `serial` (kernels with `store_split`), that the kernel sums itself through
    `counters` (`tiles`: the launch's output tiles). `strides` are (split, m, n) for the kernel's output pointer."""

    def __init__(self, y: torch.Tensor, k: int, block_k: int, split_k: int, serial: bool = False,
                 tiles: int = 0) -> None:  # y: [M, N]
        k_tiles = -(-k // block_k)
        self.k_per_split = -(-k_tiles // split_k) * block_k  # a multiple of BLOCK_K: tiles stay on the group grid
        self.splits = max(1, -(-k // self.k_per_split))
        self.y = y
        m, n = y.shape
        self.buf = y if self.splits == 1 else splitk_workspace(self.splits, m, n, y.device)
        self.strides = ((0, y.stride(0), y.stride(1)) if self.splits == 1
                        else (self.buf.stride(0), self.buf.stride(1), self.buf.stride(2)))
        self.serial = serial and self.splits > 1
        self.counters = tile_counters(y.device, tiles) if self.serial else y  # unread unless serial

    def finish(self) -> torch.Tensor:  # [M, N]
        return self.y if self.splits == 1 or self.serial else splitk_reduce(self.buf, self.y)
