"""The small-M path of the fused MoE (K split over programs, float32 partials summed by the next kernel)
under the Triton interpreter, against the torch reference on odd shapes: K not a multiple of the slices,
slices past K, idle experts, unfused activations, every partial entry written (NaN-poisoned buffers);
the grid bound; and the small-M rule of the tile config with its overrides."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from keel_kernels_triton.fused_moe import tile_config as tc
from keel_kernels_triton.fused_moe.align import moe_align_block_size
from keel_kernels_triton.fused_moe.grouped_gemm import (
    fused_experts_triton,
    invoke_fused_moe_kernel,
    live_block_bound,
)
from keel_kernels_triton.fused_moe.moe_sum import moe_sum
from keel_kernels_triton.fused_moe.tile_config import MoETileConfig, MoETileConfigError, default_split_k
from triton_test_utils import BF16_INTERPRETED_TOL, random_moe

from keel.layers.fused_moe import fused_experts_torch, moe_align_block_size_torch


def _tiles(split13: int, split2: int, block_k: int = 16) -> tuple[MoETileConfig, MoETileConfig]:
    return MoETileConfig(16, 32, block_k, 4, 1, split13), MoETileConfig(16, 32, block_k, 4, 1, split2)


# (w13 slices, w2 slices): both split; only one of them (the w2 A load sums partials into a plain C, or a
# plain A feeds split C); 3 slices of hidden 40 with block_k 16 (the last slice ragged) and 4 slices of
# intermediate 24 (slices entirely past K)
SPLITS = [(2, 2), (3, 1), (1, 4), (4, 3)]


@pytest.mark.parametrize("split13,split2", SPLITS)
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (5, 3)])
def test_small_m_path_matches_torch(interpret, split13, split2, tokens, top_k):
    x, w13, w2, w, ids = random_moe(split13 * 10 + split2 + tokens, tokens, 40, 24, 8, top_k, used=[0, 3, 4, 6, 7])
    res = torch.randn(tokens, 40)
    ref = fused_experts_torch(x, w13, w2, w, ids) + res
    out = fused_experts_triton(x, w13, w2, w, ids, "silu", res, tile_configs=_tiles(split13, split2))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_small_m_path_bf16_and_unfused_activation(interpret):
    x, w13, w2, w, ids = random_moe(7, 3, 40, 24, 6, 2, torch.bfloat16, used=[1, 2, 5])
    ref = fused_experts_torch(x.float(), w13.float(), w2.float(), w, ids)
    out = fused_experts_triton(x, w13, w2, w, ids, tile_configs=_tiles(4, 2))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=5e-2)
    x, w13, w2, w, ids = random_moe(8, 3, 40, 24, 6, 2, used=[1, 2, 5])
    for act in ("gelu", "gelu_pytorch_tanh"):  # the partials are summed in torch before the activation
        torch.testing.assert_close(fused_experts_triton(x, w13, w2, w, ids, act, tile_configs=_tiles(3, 2)),
                                   fused_experts_torch(x, w13, w2, w, ids, act), atol=1e-5, rtol=1e-5)


def test_every_partial_entry_is_written(interpret):
    x, w13, w2, w, ids = random_moe(9, 3, 40, 24, 8, 2, used=[2, 5])  # six idle experts
    c13, c2 = _tiles(3, 4)
    sorted_ids, expert_ids, total = moe_align_block_size(ids, 8, 16)
    gate_up = torch.full((3, 6, 48), float("nan"))
    invoke_fused_moe_kernel(x, w13, gate_up, None, sorted_ids, expert_ids, total, 2, c13)
    assert not gate_up.isnan().any()
    torch.testing.assert_close(gate_up.sum(0), (x.repeat_interleave(2, 0)[:, None, :] @ w13[ids.reshape(-1)]
                                                .transpose(1, 2))[:, 0], atol=1e-5, rtol=1e-5)
    down = torch.full((4, 6, 40), float("nan"))
    invoke_fused_moe_kernel(gate_up, w2, down, w.reshape(-1), sorted_ids, expert_ids, total, 1, c2, act_silu=True)
    assert not down.isnan().any()
    out = torch.full((3, 40), float("nan"))
    assert moe_sum(down.view(4, 3, 2, 40), out) is out
    torch.testing.assert_close(out, fused_experts_torch(x, w13, w2, w, ids), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="float32 partials"):
        invoke_fused_moe_kernel(x, w13, torch.empty(6, 48), None, sorted_ids, expert_ids, total, 2, c13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_sum_of_partials_rounds_each_slot(interpret, dtype):
    gen = torch.Generator().manual_seed(3)
    parts = torch.randn(3, 5, 2, 70, generator=gen)
    res = torch.randn(5, 70, generator=gen).to(dtype)
    out = torch.full((5, 70), float("nan"), dtype=dtype)
    moe_sum(parts, out, residual=res)
    ref = parts.sum(0).to(dtype).float().sum(1).to(dtype) + res  # the one-slice path's roundings
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    else:  # three truncating casts (slot, sum, residual) of values up to ~8: up to two bf16 ulps there
        torch.testing.assert_close(out, ref, atol=0.07, rtol=BF16_INTERPRETED_TOL)


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(1, 6, 64, 16), (3, 2, 8, 16), (16, 6, 64, 16),
                                                          (40, 2, 4, 16), (7, 3, 60, 32)])
def test_live_block_bound_covers_every_real_block(tokens, top_k, experts, block_m):
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
        if seed == 0:  # everything on the fewest experts
            ids = torch.arange(top_k).repeat(tokens, 1)
        _, _, total = moe_align_block_size_torch(ids, experts, block_m)
        bound = live_block_bound(ids.numel(), experts, block_m)
        assert int(total) // block_m <= bound
    assert live_block_bound(6, 64, 16) == 6  # one decode token: 6 of the buffer's 61 blocks


def test_small_m_rule_and_its_overrides(monkeypatch, tmp_path):
    assert default_split_k(1, 2048, torch.bfloat16) == 4 and default_split_k(16, 1408, torch.bfloat16) == 4
    assert default_split_k(17, 2048, torch.bfloat16) == 1  # past SMALL_M_MAX_TOKENS
    assert default_split_k(1, 2048, torch.float32) == 1 and default_split_k(1, 2048, torch.bfloat16, True) == 1
    assert tc.default_moe_tile_config(1, 64, 2816, 2048, 6, torch.bfloat16).split_k == 4
    # a tuned file: entries without SPLIT_K follow the rule, SPLIT_K overrides it either way
    monkeypatch.setattr(tc, "_device_name", lambda device: "NVIDIA H200" if device.type == "cuda" else None)
    monkeypatch.setenv(tc.CONFIG_DIR_ENV, str(tmp_path))
    tc.clear_tile_config_cache()
    base = MoETileConfig(16, 64, 128, 4, 4).to_json()
    del base["SPLIT_K"]
    body = {"1": base, "2": {**base, "SPLIT_K": 1}, "4": {**base, "SPLIT_K": 8}, "64": base}
    (tmp_path / tc.config_file_name(64, 2816, 2048, "NVIDIA H200")).write_text(json.dumps(body))
    cuda = torch.device("cuda", 0)
    splits = [tc.get_moe_tile_config(m, 64, 2816, 2048, 6, torch.bfloat16, cuda, False).split_k for m in (1, 2, 3, 64)]
    assert splits == [4, 1, 8, 1]
    tc.clear_tile_config_cache()
    with pytest.raises(MoETileConfigError, match="split_k"):
        MoETileConfig(16, 64, 64, split_k=0)
    with pytest.raises(MoETileConfigError, match="unknown keys"):
        MoETileConfig.from_json({**base, "SPLITK": 2})


def test_shipped_h200_files_keep_the_one_slice_tiles_they_were_measured_with(monkeypatch):
    """The tuned H200 tiles were measured with one K slice, and benchmarks/h200_moe_small_m.py found every
    split variant slower on the H200 (benchmarks/results/h200-moe-small-m.json), so the files pin SPLIT_K 1
    where the small-M rule would split; larger entries leave it to the rule (which gives 1)."""
    monkeypatch.setattr(tc, "_device_name", lambda device: "NVIDIA H200" if device.type == "cuda" else None)
    monkeypatch.delenv(tc.CONFIG_DIR_ENV, raising=False)
    tc.clear_tile_config_cache()
    cuda = torch.device("cuda", 0)
    for tokens, want in ((1, 1), (16, 1), (32, 1), (512, 1)):
        c13, c2 = tc.get_moe_tile_configs(tokens, (64, 2816, 2048), (64, 2048, 1408), 6, torch.bfloat16, cuda,
                                          False)
        assert (c13.split_k, c2.split_k) == (want, want)
        shipped = tc.read_tile_config_file(tc.CONFIG_DIR / tc.config_file_name(64, 2816, 2048, "NVIDIA H200"))
        entry = tc.pick_for_tokens(shipped, tokens)
        assert c13 == dataclasses.replace(entry, split_k=entry.split_k or want)
    tc.clear_tile_config_cache()


def test_small_m_benchmark_compares_main_with_the_engine_path():
    """benchmarks/h200_moe_small_m.py runs on the device only; its variants are checked here."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "h200_moe_small_m.py"
    spec = importlib.util.spec_from_file_location("h200_moe_small_m", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.TOKENS == [1, 2, 4, 8, 16] and "Prediction" in bench.__doc__
    for tokens in bench.TOKENS:
        found = bench.variants(tokens)
        (main13, main2), bounded = found["main"]
        assert (main13.split_k, main2.split_k, bounded) == (1, 1, False)
        (c13, c2), bounded = found["small_m"]
        # The engine's tiles: the rule at M <= 16 (4 slices) where no tuned file applies; on an H200 the
        # shipped files pin one slice (the measurement found the split path slower).
        want = 1 if torch.cuda.is_available() and "H200" in torch.cuda.get_device_name() else 4
        assert (c13.split_k, c2.split_k, bounded) == (want, want, True)


@pytest.mark.parametrize("split13,split2,gated", [(1, 1, False), (2, 3, False), (1, 2, True), (1, 1, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_one_token_step_skips_the_alignment_bit_for_bit(interpret, monkeypatch, split13, split2, gated, dtype):
    """One token: each route is its own M-block, its expert read from the routed ids (no alignment launch);
    the result equals the aligned path's bit for bit (the same rows, the same sums), int32 and int64 ids."""
    from keel_kernels_triton.fused_moe import grouped_gemm

    assert grouped_gemm.PAIR_BLOCKS_MAX_TOKENS >= 1
    x, w13, w2, w, ids = random_moe(split13 + 10 * split2, 1, 40, 24, 8, 3, dtype, used=[1, 4, 6])
    res = torch.randn(1, 40).to(dtype)
    c13, c2 = _tiles(split13, split2)
    if gated:
        c13 = dataclasses.replace(c13, act_epilogue=True)
    aligned = []
    calls = []
    real_align = grouped_gemm.moe_align_block_size
    monkeypatch.setattr(grouped_gemm, "moe_align_block_size", lambda *a: calls.append(1) or real_align(*a))
    for routed_ids in (ids, ids.to(torch.int32)):
        out = fused_experts_triton(x, w13, w2, w, routed_ids, "silu", res, tile_configs=(c13, c2))
        assert not calls
        monkeypatch.setattr(grouped_gemm, "PAIR_BLOCKS_MAX_TOKENS", 0)
        aligned = fused_experts_triton(x, w13, w2, w, routed_ids, "silu", res, tile_configs=(c13, c2))
        monkeypatch.setattr(grouped_gemm, "PAIR_BLOCKS_MAX_TOKENS", 1)
        assert calls and torch.equal(out, aligned)
        calls.clear()
    ref = fused_experts_torch(x.float(), w13.float(), w2.float(), w, ids) + res.float()
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
