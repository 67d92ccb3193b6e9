"""The Triton `moe_align_block_size` (one launch, or two past ALIGN_SINGLE_MAX_PAIRS pairs) (kernels-triton's fused_moe/align.py) against the core's torch version.

Interpreted on the CPU (TRITON_INTERPRET=1). The kernel promises the torch version's outputs entry for
entry (a stable sort by expert), which is stronger than what the grouped GEMM needs (the same set of rows
per expert, the same padded counts); both are checked.
"""

from __future__ import annotations

import pytest
import torch
from keel_kernels_triton.fused_moe import align as align_mod
from keel_kernels_triton.fused_moe.align import (
    align_triton_supported,
    moe_align_block_size,
    moe_align_block_size_triton,
)

from keel.layers.fused_moe import moe_align_block_size_torch


def _random_ids(tokens: int, top_k: int, experts: int, seed: int, used: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    pool = used or experts  # only experts [0, used) receive tokens
    rows = [torch.randperm(pool, generator=gen)[:top_k] for _ in range(tokens)]
    return torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)


def _check_against_torch(ids: torch.Tensor, experts: int, block_m: int, out=None) -> None:
    got = moe_align_block_size_triton(ids, experts, block_m, out=out)
    ref = moe_align_block_size_torch(ids, experts, block_m)
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == r.dtype == torch.int32 and g.shape == r.shape
    sorted_ids, expert_ids, total = got
    assert torch.equal(total, ref[2])
    # What the GEMM needs: per expert, the same rows and the same padded block run.
    flat, n = ids.reshape(-1), int(total)
    for e in range(experts):
        blocks = (expert_ids[: n // block_m] == e).nonzero().flatten().tolist()
        ref_blocks = (ref[1][: n // block_m] == e).nonzero().flatten().tolist()
        assert blocks == ref_blocks
        rows = torch.cat([sorted_ids[b * block_m : (b + 1) * block_m] for b in blocks]) if blocks else sorted_ids[:0]
        real = rows[rows < flat.numel()]
        assert set(real.tolist()) == set((flat == e).nonzero().flatten().tolist())
    # What the kernel promises beyond that: identical tensors.
    assert torch.equal(sorted_ids, ref[0]) and torch.equal(expert_ids, ref[1])


@pytest.mark.parametrize("tokens", [1, 2, 7, 33, 70])
@pytest.mark.parametrize("top_k,experts,block_m", [(6, 60, 16), (2, 8, 4), (8, 64, 16)])
def test_matches_torch(interpret, tokens, top_k, experts, block_m):
    ids = _random_ids(tokens, top_k, experts, seed=tokens * 100 + experts)
    _check_against_torch(ids, experts, block_m)
    _check_against_torch(ids.to(torch.int32), experts, block_m)  # the routing kernel's id dtype


def test_idle_experts_and_one_hot_expert(interpret):
    _check_against_torch(_random_ids(9, 3, 60, seed=1, used=5), 60, 16)  # 55 experts receive nothing
    _check_against_torch(torch.tensor([[6, 2]] * 40), 8, 16)  # 40 rows on each of two experts: 3 blocks each
    _check_against_torch(torch.tensor([[3]]), 256, 16)  # one pair, many experts
    _check_against_torch(torch.zeros(0, 2, dtype=torch.int64), 8, 16)  # empty step: all padding


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(300, 6, 64, 16), (290, 6, 64, 64), (600, 4, 256, 16),
                                                         (129, 2, 8, 4)])
def test_many_programs_match_torch(interpret, tokens, top_k, experts, block_m):
    """Steps past ALIGN_SINGLE_MAX_PAIRS: the two-launch path over several programs, same stable order."""
    assert tokens * top_k > align_mod.ALIGN_SINGLE_MAX_PAIRS
    ids = _random_ids(tokens, top_k, experts, seed=tokens + experts)
    _check_against_torch(ids.to(torch.int32), experts, block_m)
    _check_against_torch(_random_ids(tokens, top_k, experts, seed=7, used=3), experts, block_m)  # crowded experts


@pytest.mark.parametrize("tokens", [5, 100])  # one launch; two launches over 10 programs
def test_every_output_entry_is_written(interpret, tokens):
    ids = _random_ids(tokens, 6, 60, seed=2)
    max_padded = -(-(ids.numel() + 60 * 15) // 16) * 16
    poisoned = (
        torch.full((max_padded,), -123, dtype=torch.int32),
        torch.full((max_padded // 16,), 999, dtype=torch.int32),
        torch.full((1,), -1, dtype=torch.int32),
    )
    _check_against_torch(ids, 60, 16, out=poisoned)
    with pytest.raises(ValueError, match="align buffers"):
        moe_align_block_size_triton(ids, 60, 16, out=(poisoned[0][:-16], poisoned[1], poisoned[2]))


def test_dispatch_by_size(interpret, monkeypatch):
    calls = []
    real = align_mod.moe_align_block_size_triton
    monkeypatch.setattr(align_mod, "moe_align_block_size_triton", lambda *a: calls.append(a) or real(*a))
    ids = _random_ids(4, 2, 8, seed=3)
    ref = moe_align_block_size_torch(ids, 8, 16)
    for g, r in zip(moe_align_block_size(ids, 8, 16), ref, strict=True):
        assert torch.equal(g, r)
    assert len(calls) == 1
    limit = align_mod.ALIGN_TRITON_MAX_EXPERTS
    assert align_triton_supported(10**6, limit) and not align_triton_supported(1, limit + 1)
    moe_align_block_size(torch.zeros(3, 1, dtype=torch.int64), limit + 1, 16)  # too many experts: torch
    assert len(calls) == 1
