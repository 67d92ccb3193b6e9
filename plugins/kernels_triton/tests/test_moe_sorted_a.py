"""The fused MoE's sorted-activation path (`sorted_a`, tile key SORTED_A) under the Triton interpreter, against
the float32 torch reference: w13 reading the hidden rows gathered into sorted order, w2 reading the w13
epilogue's output stored in sorted order, each through a TMA descriptor, alone and together; odd shapes (K
not whole tiles), experts with 0 / 1 / many rows, NaN in the padding rows the down GEMM reads but never
stores from; the key's round trip and the refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from keel_kernels_triton.fused_moe import tile_config as tc
from keel_kernels_triton.fused_moe.align import moe_align_block_size
from keel_kernels_triton.fused_moe.grouped_gemm import fused_experts_triton, invoke_fused_moe_kernel
from keel_kernels_triton.fused_moe.tile_config import MoETileConfig, MoETileConfigError
from triton_test_utils import skewed_moe

from keel.layers.fused_moe import fused_experts_torch

EPI = MoETileConfig(16, 16, 16, 4, 1, act_epilogue=True)
PLAIN = MoETileConfig(16, 16, 16, 4, 1)
PAIRS = {  # (w13, w2)
    "both": (dataclasses.replace(EPI, sorted_a=True), dataclasses.replace(PLAIN, sorted_a=True)),
    "w13_only": (dataclasses.replace(PLAIN, sorted_a=True), PLAIN),
    "w2_only": (EPI, dataclasses.replace(PLAIN, sorted_a=True, weight_tma=True)),
    "w13_only_epilogue": (dataclasses.replace(EPI, sorted_a=True, weight_tma=True), PLAIN),
}


@pytest.mark.parametrize("name", list(PAIRS))
@pytest.mark.parametrize("tokens", [1, 19])
def test_sorted_pair_matches_torch(interpret, name, tokens):
    # hidden 40, intermediate 24: K not whole BLOCK_K tiles (the TMA box reads zeros past K), N not whole tiles
    x, w13, w2, w, ids = skewed_moe(30 + tokens, tokens, 40, 24)
    res = torch.randn(tokens, 40)
    out = fused_experts_triton(x, w13, w2, w, ids, "silu", res, tile_configs=PAIRS[name])
    torch.testing.assert_close(out, fused_experts_torch(x, w13, w2, w, ids) + res, atol=1e-5, rtol=1e-5)


def test_sorted_pair_bf16_equals_the_gathered_pair(interpret):
    """The same products in the same order, rounded at the same points: the sorted pair gives the gathered
    pair's bits."""
    x, w13, w2, w, ids = skewed_moe(5, 9, 48, 32, torch.bfloat16)
    out = fused_experts_triton(x, w13, w2, w, ids, tile_configs=PAIRS["both"])
    ref = fused_experts_triton(x, w13, w2, w, ids, tile_configs=(EPI, PLAIN))
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)


def test_padding_rows_are_read_never_stored_from(interpret):
    """w13 stores the pairs' rows of its sorted output only; NaN left in its padding rows reaches the down GEMM
    (a whole TMA box is loaded) but no output row."""
    x, w13, w2, w, ids = skewed_moe(3, 6, 32, 16)
    c13, c2 = PAIRS["both"]
    sorted_ids, expert_ids, total = moe_align_block_size(ids, 8, 16)
    rows, p = ids.numel(), sorted_ids.numel()
    act = torch.full((p, 16), float("nan"))
    invoke_fused_moe_kernel(x, w13, act, None, sorted_ids, expert_ids, total, 3, EPI, gated=True, sorted_c=True,
                            pairs=rows)
    valid = sorted_ids < rows
    assert not act[valid].isnan().any() and act[~valid].isnan().all()
    down = torch.full((rows, 32), float("nan"))
    invoke_fused_moe_kernel(act, w2, down, w.reshape(-1).float(), sorted_ids, expert_ids, total, 1, c2)
    assert not down.isnan().any()
    want = fused_experts_torch(x, w13, w2, w, ids)
    torch.testing.assert_close(down.view(6, 3, 32).sum(1), want, atol=1e-5, rtol=1e-5)


def test_sorted_a_key_round_trip_and_refusals(interpret):
    cfg = MoETileConfig(64, 128, 64, sorted_a=True)
    assert cfg.to_json()["SORTED_A"] is True and MoETileConfig.from_json(cfg.to_json()) == cfg
    assert "SORTED_A" not in MoETileConfig(64, 128, 64).to_json()
    for bad in ({"kernel": "gemv", "block_m": 4}, {"split_k": 2}, {"block_k": 512}):
        with pytest.raises(MoETileConfigError, match="sorted_a"):
            MoETileConfig(**{"block_m": 16, "block_n": 16, "block_k": 16, "sorted_a": True, **bad})
    x, w13, w2, w, ids = skewed_moe(4, 3, 40, 24)
    # the down GEMM's sorted A exists only where the w13 epilogue writes it
    with pytest.raises(MoETileConfigError, match="ACT_EPILOGUE"):
        fused_experts_triton(x, w13, w2, w, ids, tile_configs=(PLAIN, PAIRS["both"][1]))
    # another activation: token-ordered GEMMs with torch's activation between them, as for ACT_EPILOGUE
    out = fused_experts_triton(x, w13, w2, w, ids, "gelu", tile_configs=PAIRS["both"])
    torch.testing.assert_close(out, fused_experts_torch(x, w13, w2, w, ids, "gelu"), atol=1e-5, rtol=1e-5)
    sorted_ids, expert_ids, total = moe_align_block_size(ids, 8, 16)
    with pytest.raises(ValueError, match="sorted-A GEMM"):  # a token-ordered activation handed to a sorted tile
        invoke_fused_moe_kernel(x, w13, torch.empty(9, 48), None, sorted_ids, expert_ids, total, 3,
                                PAIRS["w13_only"][0])
    with pytest.raises(ValueError, match="sorted-C GEMM"):  # the pair count is not in c's shape any more
        invoke_fused_moe_kernel(x, w13, torch.empty(sorted_ids.numel(), 24), None, sorted_ids, expert_ids, total,
                                3, EPI, gated=True, sorted_c=True)


def test_lookup_resolves_one_slice_for_sorted_entries(monkeypatch, tmp_path):
    monkeypatch.setattr(tc, "_device_name", lambda device: "NVIDIA H200" if device.type == "cuda" else None)
    monkeypatch.setenv(tc.CONFIG_DIR_ENV, str(tmp_path))
    tc.clear_tile_config_cache()
    entry = {**MoETileConfig(16, 64, 128, split_k=None).to_json(), "SORTED_A": True}
    (tmp_path / tc.config_file_name(64, 2048, 1408, "NVIDIA H200")).write_text(json.dumps({"4": entry}))
    got = tc.get_moe_tile_config(4, 64, 2048, 1408, 6, torch.bfloat16, torch.device("cuda", 0), False)
    assert got.sorted_a and got.split_k == 1  # the small-M rule would split K at 4 tokens
    tc.clear_tile_config_cache()
