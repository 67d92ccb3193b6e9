"""Block-FP8 experts in the fused MoE grouped GEMM (its fp8 weight mode) under the Triton interpreter,
against the torch reference on the dequantized experts (float32): every path -- gemv, gemv with split K
and TMA weight tiles, the dot kernel weight-only (split, TMA), W8A8 with the activations quantized in
the A load (fused silu, unfused, summed split-K partials) or by a launch before -- on odd token counts,
partial edge blocks (hidden 40 and intermediate 24 in 16 x 16 blocks: a partial last K group and N
block; TMA cases take hidden 48 and intermediate 32, since a TMA row of e4m3 must be whole 16 bytes),
idle experts and NaN-poisoned outputs; the launch checks; and the fp8 tile lookup and rule."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from keel_kernels_triton.fused_moe import tile_config as tc
from keel_kernels_triton.fused_moe.align import moe_align_block_size
from keel_kernels_triton.fused_moe.grouped_gemm import (
    Fp8BlockOperands,
    fused_experts_triton,
    invoke_fused_moe_kernel,
)
from keel_kernels_triton.fused_moe.quant_gemm import fused_experts_quant_triton
from keel_kernels_triton.fused_moe.tile_config import MoETileConfig, MoETileConfigError, fp8_block_tiles
from triton_test_utils import random_moe

from keel.layers.fp8_utils import per_token_group_quant_fp8
from keel.layers.fused_moe import fused_experts_torch
from keel.layers.fused_moe.quant_config import FusedMoEQuantConfig

fp8_math = pytest.importorskip("keel_quantization.fp8_math")

BLOCK = (16, 16)
PATHS = {  # name -> tiles of both GEMMs (block_k 16: the K group; one of 32 is capped to it where allowed)
    "gemv_m1": MoETileConfig(1, 16, 32, 4, 1, kernel="gemv", a_quant="none"),
    "gemv_m2_split3_tma": MoETileConfig(2, 32, 16, 4, 1, split_k=3, kernel="gemv", weight_tma=True, a_quant="none"),
    "dot_weight_only_split2": MoETileConfig(16, 32, 16, 4, 1, split_k=2, a_quant="none"),
    "dot_weight_only_tma": MoETileConfig(16, 16, 16, 4, 1, weight_tma=True, a_quant="none"),
    "w8a8_load": MoETileConfig(16, 32, 16, 4, 1, a_quant="load"),
    "w8a8_load_split2": MoETileConfig(16, 32, 16, 4, 1, split_k=2, a_quant="load"),
    "w8a8_load_unfused": MoETileConfig(16, 32, 16, 4, 1, fused_act=False, a_quant="load"),
    "w8a8_launch": MoETileConfig(16, 32, 32, 4, 1, a_quant="launch"),
}


def fp8_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[E, N, K] float -> (e4m3, block scales, dequantized float32)."""
    qs = [fp8_math.quantize_blocks(we, BLOCK) for we in w]
    q, s = torch.stack([a for a, _ in qs]), torch.stack([b for _, b in qs])
    return q, s, torch.stack([fp8_math.dequantize(a, b, BLOCK, torch.float32) for a, b in qs])


def fp8_case(seed: int, tokens: int, dtype=torch.float32, hidden: int = 40, inter: int = 24):
    """8 experts (2 and 6 idle, expert 0 in every token), top-3."""
    x, w13, w2, w, ids = random_moe(seed, tokens, hidden, inter, 8, 3, used=[1, 3, 4, 5, 7])
    ids[:, 0] = 0
    q13, s13, d13 = fp8_experts(w13)
    q2, s2, d2 = fp8_experts(w2)
    quant = FusedMoEQuantConfig("fp8_block", s13, s2, block_shape=BLOCK)
    x = x.to(dtype)

    def ref(w8a8: bool) -> torch.Tensor:  # float32 on the dequantized experts; W8A8: inputs through e4m3
        fake = (lambda t: fp8_math.fake_quant_per_token_group(t, BLOCK[1])) if w8a8 else None
        return fused_experts_torch(x.float(), d13, d2, w, ids, quantize_input=fake)

    return x, q13, q2, w, ids, quant, ref


@pytest.mark.parametrize("name", list(PATHS))
@pytest.mark.parametrize("tokens", [1, 7])
def test_fp8_path_matches_the_reference(interpret, name, tokens):
    cfg = PATHS[name]
    x, q13, q2, w, ids, quant, ref = fp8_case(tokens, tokens, **({"hidden": 48, "inter": 32} if cfg.weight_tma else {}))
    res = torch.randn_like(x)
    out = fused_experts_triton(x, q13, q2, w, ids, "silu", res, tile_configs=(cfg, cfg), fp8=quant)
    torch.testing.assert_close(out, ref(cfg.a_quant != "none") + res, atol=1e-4, rtol=1e-4)


def test_fp8_bf16_activations_and_the_quantizer_handed_over(interpret):
    x, q13, q2, w, ids, quant, ref = fp8_case(3, 5, torch.bfloat16)
    for name in ("gemv_m1", "dot_weight_only_split2", "w8a8_load"):
        cfg = PATHS[name]
        out = fused_experts_triton(x, q13, q2, w, ids, tile_configs=(cfg, cfg), fp8=quant)
        assert out.dtype == torch.bfloat16
        # bf16 roundings of the activations and the intermediate; W8A8 re-quantizes that bf16 intermediate,
        # where a rounding apart moves an e4m3 value a step (1/16): up to ~0.07 at the output
        tol = 6e-2 if cfg.a_quant == "none" else 1.2e-1
        torch.testing.assert_close(out.float(), ref(cfg.a_quant != "none"), atol=tol, rtol=tol)
    calls = []
    quantizer = dataclasses.replace(quant, quantize_input=lambda t, g: calls.append(t.shape) or
                                    per_token_group_quant_fp8(t, g))
    cfg = PATHS["w8a8_launch"]
    out = fused_experts_quant_triton(x.float(), q13, q2, w, ids, "silu", None, quantizer, tile_configs=(cfg, cfg))
    torch.testing.assert_close(out, ref(True), atol=1e-4, rtol=1e-4)
    assert calls == [(5, 40), (15, 24)]  # both GEMM inputs, by the method's quantizer


@pytest.mark.parametrize("name", ["gemv_m1", "dot_weight_only_split2", "w8a8_load", "w8a8_launch"])
def test_fp8_gemm_writes_every_live_row_and_nothing_else(interpret, name):
    x, q13, _, _, ids, quant, _ = fp8_case(4, 5)
    cfg = fp8_block_tiles(PATHS[name], 5, BLOCK[1])
    sorted_ids, expert_ids, total = moe_align_block_size(ids, 8, cfg.block_m)
    rows, split = ids.numel(), cfg.split_k or 1
    c = torch.full((split, rows + 2, 48), float("nan"))  # two rows past the pairs stay untouched
    ops = Fp8BlockOperands(quant.w13_scale, BLOCK, torch.float32)
    a = x
    if cfg.a_quant == "launch":
        a, a_s = per_token_group_quant_fp8(x, BLOCK[1])
        ops = dataclasses.replace(ops, a_scale=a_s)
    invoke_fused_moe_kernel(a, q13, c[:, :rows] if split > 1 else c[0, :rows], None, sorted_ids, expert_ids, total, 3,
                            cfg, fp8=ops)
    assert not c[:, :rows].isnan().any() and c[:, rows:].isnan().all()
    xin = fp8_math.fake_quant_per_token_group(x, BLOCK[1]) if cfg.a_quant != "none" else x
    deq = torch.stack([fp8_math.dequantize(q, s, BLOCK, torch.float64) for q, s in zip(q13, quant.w13_scale)])
    want = torch.einsum("tk,tnk->tn", xin.repeat_interleave(3, 0).double(), deq[ids.reshape(-1)])
    torch.testing.assert_close(c[:, :rows].sum(0).double(), want, atol=1e-4, rtol=1e-4)


def test_fp8_launch_checks(interpret):
    x, q13, _, _, ids, quant, _ = fp8_case(5, 2)
    sorted_ids, expert_ids, total = moe_align_block_size(ids, 8, 16)
    c = torch.empty(6, 48)
    ops = Fp8BlockOperands(quant.w13_scale, BLOCK, torch.float32)

    def launch(cfg, a=x, fp8=ops):
        invoke_fused_moe_kernel(a, q13, c, None, sorted_ids, expert_ids, total, 3, cfg, fp8=fp8)

    with pytest.raises(ValueError, match="block scales"):
        launch(MoETileConfig(16, 32, 16, 4, 1), fp8=None)
    with pytest.raises(ValueError, match="one group"):
        launch(MoETileConfig(16, 32, 32, 4, 1, a_quant="none"))  # a 32-wide K tile spans two scale groups
    with pytest.raises(ValueError, match="launch"):
        launch(MoETileConfig(16, 32, 16, 4, 1, a_quant="launch"))  # A was not quantized first
    with pytest.raises(ValueError, match="block scales"):
        invoke_fused_moe_kernel(x, x.new_empty(8, 48, 40), c, None, sorted_ids, expert_ids, total, 3,
                                MoETileConfig(16, 32, 16, 4, 1, a_quant="load"))
    with pytest.raises(MoETileConfigError, match="A_QUANT"):
        MoETileConfig(2, 32, 16, kernel="gemv", a_quant="load")  # no fp8 MMA without tensor-core tiles


def test_fp8_tiles_rule_and_their_files(monkeypatch, tmp_path):
    dot, gemv = MoETileConfig(64, 128, 64, 8, 3), MoETileConfig(1, 16, 256, 4, 3, kernel="gemv")
    assert fp8_block_tiles(gemv, 1, 128) == dataclasses.replace(gemv, block_k=128, a_quant="none")
    assert fp8_block_tiles(dot, 256, 128).a_quant == "none"  # decode sizes: weight-only
    assert fp8_block_tiles(dot, 257, 128) == dataclasses.replace(dot, a_quant="launch")
    assert fp8_block_tiles(dataclasses.replace(dot, a_quant="load"), 8192, 128).block_k == 128  # the group
    body = dataclasses.replace(dot, a_quant="load").to_json()
    assert body["A_QUANT"] == "load" and MoETileConfig.from_json(body).a_quant == "load"
    assert "A_QUANT" not in dot.to_json()
    # an fp8 file (vLLM's name) wins over the 16-bit file of the shape, which still serves where it is absent
    monkeypatch.setattr(tc, "_device_name", lambda device: "NVIDIA H200" if device.type == "cuda" else None)
    monkeypatch.setenv(tc.CONFIG_DIR_ENV, str(tmp_path))
    tc.clear_tile_config_cache()
    suffix = tc.fp8_block_file_suffix((128, 128))
    assert tc.config_file_name(64, 2816, 2048, "NVIDIA H200", suffix) == \
        "E=64,N=2816,K=2048,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
    fp8_entry = MoETileConfig(16, 64, 128, 4, 4, weight_tma=True, a_quant="load")
    (tmp_path / tc.config_file_name(64, 2816, 2048, "NVIDIA H200", suffix)).write_text(
        json.dumps({"1": fp8_entry.to_json()}))
    (tmp_path / tc.config_file_name(64, 2816, 2048, "NVIDIA H200")).write_text(json.dumps({"1": gemv.to_json()}))
    (tmp_path / tc.config_file_name(64, 2048, 1408, "NVIDIA H200")).write_text(json.dumps({"1": dot.to_json()}))
    cuda = torch.device("cuda", 0)
    c13, c2 = tc.get_moe_tile_configs(1, (64, 2816, 2048), (64, 2048, 1408), 6, torch.bfloat16, cuda, False,
                                      fp8_block=(128, 128))
    assert c13 == fp8_entry
    assert c2 == dataclasses.replace(dot, block_m=16, a_quant="none")  # the 16-bit w2 file, block_m of w13
    assert tc.get_moe_tile_configs(1, (64, 2816, 2048), (64, 2048, 1408), 6, torch.bfloat16, cuda, False)[0] == gemv
    # 66 experts (fused shared experts) fall back to the same shape's fp8 file, not to a 16-bit one
    assert tc.get_moe_tile_configs(1, (66, 2816, 2048), (66, 2048, 1408), 8, torch.bfloat16, cuda, False,
                                   fp8_block=(128, 128))[0] == fp8_entry
    tc.clear_tile_config_cache()
