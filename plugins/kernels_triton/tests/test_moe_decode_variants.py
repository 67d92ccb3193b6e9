"""The decode-size variants of the fused MoE grouped GEMM under the Triton interpreter, against the float32
torch reference: the GEMV main loop (`kernel` "gemv", block_m 1-16), weight tiles through a TMA
descriptor (`weight_tma`), each alone, together and with split K; odd shapes (K not whole tiles, N not
whole tiles), experts with 0 / 1 / many rows, NaN-poisoned outputs (every row written, nothing else);
and their tile-config keys."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from keel_kernels_triton.fused_moe import tile_config as tc
from keel_kernels_triton.fused_moe.align import moe_align_block_size
from keel_kernels_triton.fused_moe.grouped_gemm import fused_experts_triton, invoke_fused_moe_kernel
from keel_kernels_triton.fused_moe.tile_config import MoETileConfig, MoETileConfigError
from triton_test_utils import random_moe

from keel.layers.fused_moe import fused_experts_torch

VARIANTS = {
    "gemv_m1": MoETileConfig(1, 16, 16, 4, 1, kernel="gemv"),
    "gemv_m2_split3": MoETileConfig(2, 32, 16, 4, 1, split_k=3, kernel="gemv"),
    "gemv_m4_tma": MoETileConfig(4, 16, 32, 4, 1, kernel="gemv", weight_tma=True),
    "dot_tma": MoETileConfig(16, 32, 16, 4, 1, weight_tma=True),
    "dot_tma_split2": MoETileConfig(16, 16, 16, 4, 1, split_k=2, weight_tma=True),
}


def _skewed_moe(seed: int, tokens: int, hidden: int, inter: int, dtype=torch.float32):
    """8 experts: 2 and 6 idle, expert 0 in every token (many rows), 7 in exactly one token, the rest random."""
    x, w13, w2, w, ids = random_moe(seed, tokens, hidden, inter, 8, 3, dtype, used=[1, 3, 4, 5])
    ids[:, 0] = 0
    ids[0, 1] = 7
    return x, w13, w2, w, ids


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("tokens", [1, 7])
def test_variant_matches_torch(interpret, name, tokens):
    # hidden 40, intermediate 24: neither whole block_k tiles nor whole block_n tiles
    x, w13, w2, w, ids = _skewed_moe(tokens, tokens, 40, 24)
    res = torch.randn(tokens, 40)
    cfg = VARIANTS[name]
    out = fused_experts_triton(x, w13, w2, w, ids, "silu", res, tile_configs=(cfg, cfg))
    torch.testing.assert_close(out, fused_experts_torch(x, w13, w2, w, ids) + res, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["gemv_m1", "gemv_m4_tma", "dot_tma"])
def test_variant_bf16_rounds_like_the_dot_path(interpret, name):
    x, w13, w2, w, ids = _skewed_moe(11, 5, 48, 32, torch.bfloat16)
    cfg = VARIANTS[name]
    base = MoETileConfig(16, cfg.block_n, cfg.block_k, 4, 1)
    out = fused_experts_triton(x, w13, w2, w, ids, tile_configs=(cfg, cfg))
    ref = fused_experts_triton(x, w13, w2, w, ids, tile_configs=(base, base))
    assert out.dtype == torch.bfloat16
    # the same float32 sums in another order, rounded to bf16 at the same points: at most a bf16 ulp apart
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), fused_experts_torch(x.float(), w13.float(), w2.float(), w, ids),
                               atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("name", ["gemv_m1", "gemv_m4_tma", "dot_tma"])
def test_variant_writes_every_row_and_nothing_else(interpret, name):
    x, w13, w2, w, ids = _skewed_moe(5, 4, 40, 24)
    cfg = VARIANTS[name]
    sorted_ids, expert_ids, total = moe_align_block_size(ids, 8, cfg.block_m)
    rows = ids.numel()
    gate_up = torch.full((rows + 2, 48), float("nan"))  # two rows past the pairs stay untouched
    invoke_fused_moe_kernel(x, w13, gate_up[:rows], None, sorted_ids, expert_ids, total, 3, cfg)
    assert not gate_up[:rows].isnan().any() and gate_up[rows:].isnan().all()
    want = (x.repeat_interleave(3, 0)[:, None, :] @ w13[ids.reshape(-1)].transpose(1, 2))[:, 0]
    torch.testing.assert_close(gate_up[:rows], want, atol=1e-5, rtol=1e-5)


def test_tile_config_keys_of_the_variants(monkeypatch, tmp_path):
    gemv = MoETileConfig(2, 32, 256, 4, 3, kernel="gemv", weight_tma=True)
    body = gemv.to_json()
    assert body["KERNEL"] == "gemv" and body["WEIGHT_TMA"] is True
    assert MoETileConfig.from_json(body) == gemv
    assert "KERNEL" not in MoETileConfig(16, 64, 64).to_json()  # old files read back unchanged
    with pytest.raises(MoETileConfigError, match="at least 16"):
        MoETileConfig(2, 32, 64)  # block_m < 16 needs the gemv loop
    with pytest.raises(MoETileConfigError, match="block_m <= 16"):
        MoETileConfig(32, 32, 64, kernel="gemv")
    with pytest.raises(MoETileConfigError, match="KERNEL"):
        MoETileConfig(16, 32, 64, kernel="wgmma")
    with pytest.raises(MoETileConfigError, match="TMA boxes"):
        MoETileConfig(16, 32, 512, weight_tma=True)
    # a tuned file selects the variant per token count
    monkeypatch.setattr(tc, "_device_name", lambda device: "NVIDIA H200" if device.type == "cuda" else None)
    monkeypatch.setenv(tc.CONFIG_DIR_ENV, str(tmp_path))
    tc.clear_tile_config_cache()
    dot = MoETileConfig(16, 64, 128, 4, 4)
    (tmp_path / tc.config_file_name(64, 2816, 2048, "NVIDIA H200")).write_text(
        json.dumps({"2": gemv.to_json(), "64": dot.to_json()}))
    cuda = torch.device("cuda", 0)
    got = [tc.get_moe_tile_config(m, 64, 2816, 2048, 6, torch.bfloat16, cuda, False) for m in (1, 2, 3)]
    assert got == [gemv, gemv, dot]
    # 66 experts (two shared experts fused into the routed GEMM) fall back to the same N, K file
    assert tc.get_moe_tile_config(1, 66, 2816, 2048, 6, torch.bfloat16, cuda, False) == gemv
    tc.clear_tile_config_cache()


def test_both_gemms_share_a_gemv_block_m(monkeypatch, tmp_path):
    monkeypatch.setattr(tc, "_device_name", lambda device: "NVIDIA H200" if device.type == "cuda" else None)
    monkeypatch.setenv(tc.CONFIG_DIR_ENV, str(tmp_path))
    tc.clear_tile_config_cache()
    (tmp_path / tc.config_file_name(64, 96, 80, "NVIDIA H200")).write_text(
        json.dumps({"1": MoETileConfig(2, 32, 64, kernel="gemv").to_json()}))
    (tmp_path / tc.config_file_name(64, 80, 48, "NVIDIA H200")).write_text(
        json.dumps({"1": MoETileConfig(16, 64, 32).to_json()}))
    c13, c2 = tc.get_moe_tile_configs(1, (64, 96, 80), (64, 80, 48), 6, torch.bfloat16, torch.device("cuda", 0),
                                      False)
    assert (c13.block_m, c2.block_m, c2.kernel) == (2, 2, "gemv")  # a tensor-core tile cannot hold 2 rows
    tc.clear_tile_config_cache()
    x, w13, w2, w, ids = random_moe(1, 2, 40, 24, 8, 2)
    with pytest.raises(ValueError, match="one block_m"):
        fused_experts_triton(x, w13, w2, w, ids, tile_configs=(c13, MoETileConfig(16, 64, 128)))


def test_decode_sweep_candidates_cover_every_variant():
    """benchmarks/h200_moe_decode_sweep.py runs on the device (its --smoke run interpreted, by hand); here:
    each token count offers every kind the sizes call for, valid configs only, and a shared block_m."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "h200_moe_decode_sweep.py"
    spec = importlib.util.spec_from_file_location("h200_moe_decode_sweep", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    assert sorted(sweep.ORDER) == sweep.TOKENS == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert "Prediction" in sweep.__doc__
    shipped = MoETileConfig(16, 64, 128, 4, 4)
    for tokens in sweep.TOKENS:
        found = sweep.candidates(tokens, shipped, MoETileConfig)
        assert found[0] == shipped and len(set(found)) == len(found)
        kinds = {(c.kernel, c.weight_tma) for c in found}
        assert {("dot", False), ("dot", True)} <= kinds
        if tokens <= 32:
            assert {("gemv", False), ("gemv", True)} <= kinds
            assert {c.block_m for c in found if c.kernel == "gemv"} == set(sweep.GEMV_BLOCK_M[tokens])
        if tokens >= 128:
            assert {16, 32, 64} <= {c.block_m for c in found}
        smoke = sweep.candidates(tokens, shipped, MoETileConfig, smoke=True)
        assert len(smoke) <= 6 and {(c.kernel, c.weight_tma) for c in smoke} == kinds
        # --focus w2: the down GEMM fused and unfused at every size, w13 tiles for each of its block_m
        w2 = sweep.candidates(tokens, shipped, MoETileConfig, gemm="w2", focus="w2")
        w13 = sweep.candidates(tokens, shipped, MoETileConfig, gemm="w13", focus="w2")
        assert {c.fused_act for c in w2 if c.kernel == "dot"} == {True, False}
        assert {c.block_m for c in w2} <= {c.block_m for c in w13}
        assert all(c.fused_act for c in w13[1:])


@pytest.mark.parametrize("block_m", [1, 2, 4, 8])
def test_alignment_pads_to_gemv_block_m_like_torch(interpret, block_m):
    from keel.layers.fused_moe import moe_align_block_size_torch

    gen = torch.Generator().manual_seed(block_m)
    ids = torch.stack([torch.randperm(64, generator=gen)[:6] for _ in range(16)])
    ids[:5, 0] = 3  # one expert with five rows: several blocks
    for got, want in zip(moe_align_block_size(ids, 64, block_m), moe_align_block_size_torch(ids, 64, block_m)):
        assert torch.equal(got.to(want.dtype), want)


EPILOGUE = {
    "dot": MoETileConfig(16, 16, 16, 4, 1, act_epilogue=True),
    "dot_tma": MoETileConfig(16, 16, 32, 4, 1, weight_tma=True, act_epilogue=True),
    "gemv_m2": MoETileConfig(2, 16, 16, 4, 1, kernel="gemv", act_epilogue=True),
    "gemv_m1_tma": MoETileConfig(1, 16, 32, 4, 1, kernel="gemv", weight_tma=True, act_epilogue=True),
}


@pytest.mark.parametrize("name", list(EPILOGUE))
@pytest.mark.parametrize("tokens", [1, 7])
def test_act_epilogue_matches_torch(interpret, name, tokens):
    # hidden 40, intermediate 24: K not whole tiles, the gate / up halves not whole N-blocks
    x, w13, w2, w, ids = _skewed_moe(20 + tokens, tokens, 40, 24)
    res = torch.randn(tokens, 40)
    c13 = EPILOGUE[name]
    c2 = dataclasses.replace(c13, act_epilogue=False)
    out = fused_experts_triton(x, w13, w2, w, ids, "silu", res, tile_configs=(c13, c2))
    torch.testing.assert_close(out, fused_experts_torch(x, w13, w2, w, ids) + res, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["dot", "gemv_m1_tma"])
def test_act_epilogue_rounds_like_the_a_load_path_in_bf16(interpret, name):
    """silu(gate) * up stored by the w13 GEMM rounds where torch's F.silu(gate) * up rounds: gate and up as
    the plain GEMM stores them (bit-equal here), silu rounded, the product rounded. The interpreter's
    float32 -> bf16 casts truncate where torch (and compiled Triton) round to nearest, so here the product
    is within two bf16 steps; the GPU test holds it to torch's bits."""
    x, w13, w2, w, ids = _skewed_moe(13, 5, 48, 32, torch.bfloat16)
    c13 = EPILOGUE[name]
    base13 = dataclasses.replace(c13, act_epilogue=False)
    sorted_ids, expert_ids, total = moe_align_block_size(ids, 8, c13.block_m)
    rows = ids.numel()
    act = torch.full((rows + 2, 32), float("nan"), dtype=torch.bfloat16)  # rows past the pairs stay untouched
    invoke_fused_moe_kernel(x, w13, act[:rows], None, sorted_ids, expert_ids, total, 3, c13, gated=True)
    assert not act[:rows].isnan().any() and act[rows:].isnan().all()
    gate_up = torch.empty(rows, 64, dtype=torch.bfloat16)
    invoke_fused_moe_kernel(x, w13, gate_up, None, sorted_ids, expert_ids, total, 3, base13)
    want = torch.nn.functional.silu(gate_up[:, :32]) * gate_up[:, 32:]
    torch.testing.assert_close(act[:rows].float(), want.float(), atol=1e-6, rtol=2 * 2**-7)


def test_act_epilogue_config_and_refusals(interpret):
    cfg = MoETileConfig(16, 64, 128, act_epilogue=True)
    assert cfg.to_json()["ACT_EPILOGUE"] is True and MoETileConfig.from_json(cfg.to_json()) == cfg
    assert "ACT_EPILOGUE" not in MoETileConfig(16, 64, 128).to_json()
    assert MoETileConfig.from_json({**MoETileConfig(16, 64, 128, split_k=None).to_json(),
                                    "ACT_EPILOGUE": True}).split_k is None
    with pytest.raises(MoETileConfigError, match="one K slice"):
        MoETileConfig(16, 64, 128, split_k=2, act_epilogue=True)
    x, w13, w2, w, ids = _skewed_moe(3, 2, 40, 24)
    sorted_ids, expert_ids, total = moe_align_block_size(ids, 8, 16)
    with pytest.raises(ValueError, match="silu epilogue"):
        invoke_fused_moe_kernel(x, w13, torch.empty(ids.numel(), 48), None, sorted_ids, expert_ids, total, 3,
                                MoETileConfig(16, 16, 16), gated=True)
    # another activation than silu: the epilogue flag leaves the w13 GEMM plain, torch applies it
    c13 = MoETileConfig(16, 16, 16, 4, 1, act_epilogue=True)
    c2 = MoETileConfig(16, 16, 16, 4, 1)
    out = fused_experts_triton(x, w13, w2, w, ids, "gelu", tile_configs=(c13, c2))
    torch.testing.assert_close(out, fused_experts_torch(x, w13, w2, w, ids, "gelu"), atol=1e-5, rtol=1e-5)


def test_act_epilogue_lookup_resolves_one_slice(monkeypatch, tmp_path):
    monkeypatch.setattr(tc, "_device_name", lambda device: "NVIDIA H200" if device.type == "cuda" else None)
    monkeypatch.setenv(tc.CONFIG_DIR_ENV, str(tmp_path))
    tc.clear_tile_config_cache()
    entry = {**MoETileConfig(16, 64, 128, split_k=None).to_json(), "ACT_EPILOGUE": True}
    (tmp_path / tc.config_file_name(64, 2816, 2048, "NVIDIA H200")).write_text(json.dumps({"4": entry}))
    got = tc.get_moe_tile_config(4, 64, 2816, 2048, 6, torch.bfloat16, torch.device("cuda", 0), False)
    assert got.act_epilogue and got.split_k == 1  # the small-M rule would split K at 4 tokens
    tc.clear_tile_config_cache()
