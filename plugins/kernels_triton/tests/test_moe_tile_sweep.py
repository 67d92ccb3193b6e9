"""The H200 tile sweep (benchmarks/h200_moe_tiles.py) cannot run here; its grid can be checked: every
candidate is a valid config that fits sm_90 shared memory, pruning follows the token count, and the
number of compiles (the sweep's main cost) stays bounded."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from keel_kernels_triton.fused_moe.tile_config import MoETileConfig

SWEEP = Path(__file__).resolve().parents[3] / "benchmarks" / "h200_moe_tiles.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("h200_moe_tiles", SWEEP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grid_is_valid_and_compiles_are_bounded(sweep):
    all_cfgs = set()
    for tokens in sweep.TOKENS:
        cands = sweep.candidates(tokens)
        assert len(cands) >= 10
        for c in cands:
            assert isinstance(c, MoETileConfig)
            # a conservative bound of the pipelined tiles (bf16): within an H200 block's 227 KiB
            assert c.num_stages * (c.block_m * c.block_k + c.block_k * c.block_n) * 2 <= 232448
        all_cfgs |= set(cands)
    assert 24 <= len(all_cfgs) <= 40
    assert 2 * len(all_cfgs) <= 80  # one compile per config and GEMM


def test_pruning_by_token_count(sweep):
    assert {c.block_m for c in sweep.candidates(1)} == {16}
    assert {c.block_m for c in sweep.candidates(16)} == {16, 32}
    assert {c.block_m for c in sweep.candidates(128)} == {16, 32, 64}
    assert {c.block_m for c in sweep.candidates(2048)} == {32, 64, 128}
    assert {c.block_m for c in sweep.candidates(512)} == {16, 32, 64}
    assert {c.group_m for c in sweep.candidates(256)} == {1}  # grouped orders from prefill sizes on
    assert {c.group_m for c in sweep.candidates(512)} >= {1, 8}
    assert sweep.LEGACY in sweep.candidates(1)
