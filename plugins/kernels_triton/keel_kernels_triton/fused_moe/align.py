"""`moe_align_block_size` in Triton: one launch for small (decode) batches, two for big ones, where the
torch version's ~20 tiny kernels (a radix sort among them) cost more than the grouped GEMMs they prepare
(at a batch of 256 DeepSeek-V2-Lite decode tokens: 63 us per layer in torch, 1.65 ms of a 15.2 ms step).

`moe_align_block_size` (called by the fused experts, grouped_gemm.py) takes the kernels for up to
ALIGN_TRITON_MAX_EXPERTS experts; more experts keep the core's torch version
(`keel.layers.fused_moe.align.moe_align_block_size_torch`), which stays the reference. The output contract is the torch version's, entry for entry: sorted_token_ids lists the flat
(token * top_k + slot) indices grouped by expert in ascending flat order (a stable sort), each expert's
run padded with the sentinel num_pairs to a multiple of block_m; expert_ids[b] is the expert of block b
(0 past the end); total is the padded length. Buffers are sized from shapes alone (no host sync).

A single program does everything, so its phases need no grid-wide synchronization, and every output
entry is written exactly once (no zero-fill followed by a racing scatter): counts per expert by one-hot
sums over chunks of pairs; padded offsets by a cumulative sum over experts; then each pair's slot
(= its expert's padded start + pairs of that expert before it), each expert's padding tail, the tail past
`total`, and each expert's block ids.

Past ALIGN_SINGLE_MAX_PAIRS pairs one program would loop too long, so the work is split over programs of
`pairs_per_program` pairs each (a number fixed by the shape, so CUDA graphs capture it): `_count_kernel`
writes each program's per-expert counts; `_scatter_kernel` (same grid) sums the rows before its own to
find where its pairs go -- the same stable order -- and the programs share the padding, block-id and
tail stores, each entry still written by exactly one program.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from keel.layers.fused_moe.align import moe_align_block_size_torch
from keel_kernels_triton.pdl import pdl_kwargs
from keel_kernels_triton.support import interpreter_enabled

# Up to this many pairs one program loops over them all (one launch); past it, two launches over
# programs of `pairs_per_program(num_pairs)` pairs. A tuning knob.
ALIGN_SINGLE_MAX_PAIRS = 256
# Expert vectors one program holds; more experts keep the torch version.
ALIGN_TRITON_MAX_EXPERTS = 1024
_CHUNK = 32  # pairs per loop iteration: a [_CHUNK, experts] one-hot tile
_TAIL = 256  # sentinel / block-id stores per loop iteration past `total`


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _align_kernel(
    ids_ptr,  # [num_pairs] int, flat (token, slot) -> expert
    sorted_ptr,  # [max_padded] int32, written
    expert_ids_ptr,  # [max_padded // BLOCK_M] int32, written
    total_ptr,  # [1] int32, written
    num_pairs,
    max_padded,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    TAIL: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch (keel_kernels_triton.pdl): wait before touching memory
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # tl.reduce / tl.associative_scan with triton.language.standard's combines rather than tl.sum /
    # tl.cumsum: see routing_triton.py (the jitted helpers are bound to the mode triton was imported in).
    e_idx = tl.arange(0, BLOCK_E)
    c_idx = tl.arange(0, CHUNK)
    real_expert = e_idx[None, :] < NUM_EXPERTS  # [1, BLOCK_E]; out-of-range ids are dropped
    counts = tl.full((BLOCK_E,), 0, dtype=tl.int32)
    for c in range(0, num_pairs, CHUNK):
        pair = c + c_idx
        ids = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1).to(tl.int32)
        onehot = ((ids[:, None] == e_idx[None, :]) & real_expert).to(tl.int32)  # [CHUNK, BLOCK_E]
        counts += tl.reduce(onehot, 0, tl.standard._sum_combine)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_start = tl.associative_scan(padded, 0, tl.standard._sum_combine) - padded
    total = tl.reduce(padded, 0, tl.standard._sum_combine)
    tl.store(total_ptr, total)

    # Each pair's slot: its expert's start + pairs of that expert in earlier chunks + earlier in this chunk.
    seen = padded_start
    for c in range(0, num_pairs, CHUNK):
        pair = c + c_idx
        live = pair < num_pairs
        ids = tl.load(ids_ptr + pair, mask=live, other=-1).to(tl.int32)
        onehot = ((ids[:, None] == e_idx[None, :]) & real_expert).to(tl.int32)  # [CHUNK, BLOCK_E]
        base = tl.reduce(onehot * seen[None, :], 1, tl.standard._sum_combine)  # [CHUNK]
        before = (ids[:, None] == ids[None, :]) & (c_idx[None, :] < c_idx[:, None])  # [CHUNK, CHUNK]
        rank = tl.reduce(before.to(tl.int32), 1, tl.standard._sum_combine)
        tl.store(sorted_ptr + base + rank, pair, mask=live & (ids >= 0) & (ids < NUM_EXPERTS))
        seen += tl.reduce(onehot, 0, tl.standard._sum_combine)

    # Each expert's padding tail: [start + count, start + padded).
    m_idx = tl.arange(0, BLOCK_M)
    pad_pos = (padded_start + counts)[:, None] + m_idx[None, :]  # [BLOCK_E, BLOCK_M]
    tl.store(sorted_ptr + pad_pos, tl.full((BLOCK_E, BLOCK_M), 0, tl.int32) + num_pairs,
             mask=m_idx[None, :] < (padded - counts)[:, None])
    # Each expert's blocks; an expert holds at most ceil(num_pairs / BLOCK_M) of them.
    first_block = padded_start // BLOCK_M
    num_blocks = padded // BLOCK_M
    for b in range(0, num_pairs, BLOCK_M):
        nth = b // BLOCK_M
        tl.store(expert_ids_ptr + first_block + nth, e_idx, mask=nth < num_blocks)
    # Past the real end: sentinel rows and expert 0 (those blocks exit before reading it).
    t_idx = tl.arange(0, TAIL)
    for p in range(0, max_padded, TAIL):
        pos = p + t_idx
        tail = (pos >= total) & (pos < max_padded)
        tl.store(sorted_ptr + pos, tl.full((TAIL,), 0, tl.int32) + num_pairs, mask=tail)
        tl.store(expert_ids_ptr + pos // BLOCK_M, tl.full((TAIL,), 0, tl.int32),
                 mask=tail & (pos % BLOCK_M == 0))


def _count_kernel(
    ids_ptr,  # [num_pairs] int, flat (token, slot) -> expert
    counts_ptr,  # [num_programs, BLOCK_E] int32, written: each program's pairs per expert
    num_pairs,
    PAIRS: tl.constexpr,  # pairs per program
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch (keel_kernels_triton.pdl): wait before touching memory
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    e_idx = tl.arange(0, BLOCK_E)
    c_idx = tl.arange(0, CHUNK)
    real_expert = e_idx[None, :] < NUM_EXPERTS
    counts = tl.full((BLOCK_E,), 0, dtype=tl.int32)
    for c in range(0, PAIRS, CHUNK):
        pair = pid * PAIRS + c + c_idx
        ids = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1).to(tl.int32)
        onehot = ((ids[:, None] == e_idx[None, :]) & real_expert).to(tl.int32)  # [CHUNK, BLOCK_E]
        counts += tl.reduce(onehot, 0, tl.standard._sum_combine)
    tl.store(counts_ptr + pid * BLOCK_E + e_idx, counts)


def _scatter_kernel(
    ids_ptr,  # [num_pairs] int
    counts_ptr,  # [num_programs, BLOCK_E] int32, from _count_kernel
    sorted_ptr,  # [max_padded] int32, written
    expert_ids_ptr,  # [max_padded // BLOCK_M] int32, written
    total_ptr,  # [1] int32, written
    num_pairs,
    max_padded,
    PAIRS: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    TAIL: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch (keel_kernels_triton.pdl): wait before touching memory
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    e_idx = tl.arange(0, BLOCK_E)
    c_idx = tl.arange(0, CHUNK)
    real_expert = e_idx[None, :] < NUM_EXPERTS
    counts = tl.full((BLOCK_E,), 0, dtype=tl.int32)
    before = tl.full((BLOCK_E,), 0, dtype=tl.int32)  # pairs per expert in earlier programs
    for r in range(0, num_programs):
        row = tl.load(counts_ptr + r * BLOCK_E + e_idx)
        counts += row
        before += tl.where(r < pid, row, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_start = tl.associative_scan(padded, 0, tl.standard._sum_combine) - padded
    total = tl.reduce(padded, 0, tl.standard._sum_combine)

    seen = padded_start + before
    for c in range(0, PAIRS, CHUNK):
        pair = pid * PAIRS + c + c_idx
        live = pair < num_pairs
        ids = tl.load(ids_ptr + pair, mask=live, other=-1).to(tl.int32)
        onehot = ((ids[:, None] == e_idx[None, :]) & real_expert).to(tl.int32)  # [CHUNK, BLOCK_E]
        base = tl.reduce(onehot * seen[None, :], 1, tl.standard._sum_combine)  # [CHUNK]
        earlier = (ids[:, None] == ids[None, :]) & (c_idx[None, :] < c_idx[:, None])  # [CHUNK, CHUNK]
        rank = tl.reduce(earlier.to(tl.int32), 1, tl.standard._sum_combine)
        tl.store(sorted_ptr + base + rank, pair, mask=live & (ids >= 0) & (ids < NUM_EXPERTS))
        seen += tl.reduce(onehot, 0, tl.standard._sum_combine)

    if pid == 0:
        tl.store(total_ptr, total)
        m_idx = tl.arange(0, BLOCK_M)
        pad_pos = (padded_start + counts)[:, None] + m_idx[None, :]  # [BLOCK_E, BLOCK_M]
        tl.store(sorted_ptr + pad_pos, tl.full((BLOCK_E, BLOCK_M), 0, tl.int32) + num_pairs,
                 mask=m_idx[None, :] < (padded - counts)[:, None])
    # Each expert's blocks (block nth of every expert by program nth % num_programs), then the tail.
    first_block = padded_start // BLOCK_M
    num_blocks = padded // BLOCK_M
    for nth in range(pid, tl.cdiv(num_pairs, BLOCK_M), num_programs):
        tl.store(expert_ids_ptr + first_block + nth, e_idx, mask=nth < num_blocks)
    t_idx = tl.arange(0, TAIL)
    for p in range(pid * TAIL, max_padded, num_programs * TAIL):
        pos = p + t_idx
        tail = (pos >= total) & (pos < max_padded)
        tl.store(sorted_ptr + pos, tl.full((TAIL,), 0, tl.int32) + num_pairs, mask=tail)
        tl.store(expert_ids_ptr + pos // BLOCK_M, tl.full((TAIL,), 0, tl.int32),
                 mask=tail & (pos % BLOCK_M == 0))


@functools.cache
def _jitted(interpret: bool, kernel: str = "align") -> Any:
    del interpret  # part of the cache key only: triton.jit reads TRITON_INTERPRET itself
    # The pair counts vary per step; specialized (divisible by 16 or not) they made a variant the
    # startup warm-up never compiles -- its power-of-two prefills give pair counts divisible by 16 --
    # and the first real big batch compiled it: ~1 s of DeepSeek-V2-Lite's first round on an H200.
    fn = {"align": _align_kernel, "count": _count_kernel, "scatter": _scatter_kernel}[kernel]
    varying = ["num_pairs"] if kernel == "count" else ["num_pairs", "max_padded"]
    return triton.jit(fn, do_not_specialize=varying)


def pairs_per_program(num_pairs: int) -> int:
    """Pairs one program of the two-launch path takes: a power of two >= 64, at most ~128 programs (each
    scatter program reads every program's counts row)."""
    return max(64, _next_pow2(-(-num_pairs // 128)))


def align_triton_supported(num_pairs: int, num_experts: int) -> bool:
    """Whether `moe_align_block_size` should use the kernels for this many pairs and experts."""
    del num_pairs  # any step size: one launch up to ALIGN_SINGLE_MAX_PAIRS, two past it
    return num_experts <= ALIGN_TRITON_MAX_EXPERTS


def moe_align_block_size(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids [max_padded] int32, expert_ids [max_padded // block_m] int32, total [1] int32), as
    `moe_align_block_size_torch` defines them: one launch for small steps (`align_triton_supported`), the
    torch version otherwise; both give identical outputs."""
    if align_triton_supported(topk_ids.numel(), num_experts):
        return moe_align_block_size_triton(topk_ids, num_experts, block_m)
    return moe_align_block_size_torch(topk_ids, num_experts, block_m)


def moe_align_block_size_triton(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    num_experts: int,
    block_m: int,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # buffers to write (tests poison them)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids [max_padded] int32, expert_ids [max_padded // block_m] int32, total [1] int32),
    identical to the torch `moe_align_block_size`; the caller checks `align_triton_supported`."""
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_pairs = flat.numel()
    max_padded = num_pairs + num_experts * (block_m - 1)
    max_padded = -(-max_padded // block_m) * block_m
    device = flat.device
    if out is None:
        sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
        expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32, device=device)
        total = torch.empty(1, dtype=torch.int32, device=device)
    else:
        sorted_ids, expert_ids, total = out
        if sorted_ids.numel() != max_padded or expert_ids.numel() != max_padded // block_m or total.numel() != 1:
            raise ValueError(
                f"align buffers must hold {max_padded}, {max_padded // block_m} and 1 entries; got "
                f"{sorted_ids.numel()}, {expert_ids.numel()}, {total.numel()}"
            )
    block_e = _next_pow2(num_experts)
    warps = 4 if block_e <= 256 else 8
    if num_pairs > ALIGN_SINGLE_MAX_PAIRS:
        pairs = pairs_per_program(num_pairs)
        grid = (-(-num_pairs // pairs),)
        counts = torch.empty((grid[0], block_e), dtype=torch.int32, device=device)
        interp = interpreter_enabled()
        _jitted(interp, "count")[grid](flat, counts, num_pairs, PAIRS=pairs, NUM_EXPERTS=num_experts,
                                       BLOCK_E=block_e, CHUNK=_CHUNK, num_warps=warps, **pdl_kwargs(flat))
        _jitted(interp, "scatter")[grid](flat, counts, sorted_ids, expert_ids, total, num_pairs, max_padded,
                                         PAIRS=pairs, NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK_E=block_e,
                                         CHUNK=_CHUNK, TAIL=_TAIL, num_warps=warps, **pdl_kwargs(flat))
        return sorted_ids, expert_ids, total
    _jitted(interpreter_enabled())[(1,)](
        flat,
        sorted_ids,
        expert_ids,
        total,
        num_pairs,
        max_padded,
        NUM_EXPERTS=num_experts,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        CHUNK=_CHUNK,
        TAIL=_TAIL,
        num_warps=warps,
        **pdl_kwargs(flat),
    )
    return sorted_ids, expert_ids, total
