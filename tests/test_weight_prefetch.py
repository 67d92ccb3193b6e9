"""keel.weight_prefetch: how much of its weight a decode GEMV asks L2 for before its PDL wait."""

from __future__ import annotations

from keel.weight_prefetch import WEIGHT_PREFETCH_BYTES, weight_prefetch_k

ON = {"PDL": True, "launch_pdl": True}


def test_nothing_without_pdl():
    assert weight_prefetch_k({}, 4096, 64, 128) == 0


def test_the_split_whole_where_the_budget_allows_else_its_start():
    assert weight_prefetch_k(ON, 1024, 64, 128) == 1024  # a W8A8 program's whole split: 64 KB
    assert weight_prefetch_k(ON, 3584, 64, 128) == 1024  # past the budget: its first 64 KB
    assert weight_prefetch_k(ON, 4096, 8, 128) == 4096  # an 8-row fp8 GEMV, whole rows
    assert weight_prefetch_k(ON, 7168, 8, 8) == 8192  # int4 words of 16 columns: the kernel clamps to the split
    assert weight_prefetch_k(ON, 100, 64, 128) == 128  # at least one line


def test_a_power_of_two_within_the_budget():
    for k in (16, 100, 1000, 2048, 2816, 4096, 14336):
        for per_input in (1, 8, 16, 64, 128, 256):
            n = weight_prefetch_k(ON, k, per_input, 8)
            assert n & (n - 1) == 0 and n >= 8
            assert n == 8 or n * per_input <= WEIGHT_PREFETCH_BYTES
