"""Wiring: the `quantization` engine argument and flag, the checkpoint's quantization_config, the
registry, and every way a setting could be silently ignored -- each is an error naming it."""

from __future__ import annotations

import json

import pytest
from keel_quantization.compressed_tensors import CompressedTensorsConfig
from keel_quantization.fp8 import Fp8Config
from keel_quantization.quantizer import quantize_checkpoint
from quant_test_utils import float_llama, make_engine

from keel.config import ConfigError, EngineArgs
from keel.models.weights import WeightLoadError
from keel.quantization import QuantizationError


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("cfg")
    src = float_llama(root / "src", num_hidden_layers=1)
    return {"src": src, "block": quantize_checkpoint(src, root / "block", "fp8-block", block=(16, 16))}


def test_plugins_list_shows_the_methods(capsys):
    from keel.cli import main

    assert main(["plugins", "list"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("quantization:"))
    assert "fp8" in line and "compressed-tensors" in line


def test_flag_and_llm_accept_quantization_and_kv_cache_dtype(ckpts):
    import argparse

    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--quantization", "fp8", "--kv-cache-dtype", "auto"])
    assert (ns.quantization, ns.kv_cache_dtype) == ("fp8", "auto")
    from keel import LLM, SamplingParams

    llm = LLM(str(ckpts["block"]), quantization="fp8", kv_cache_dtype="auto", skip_tokenizer_init=True,
              dtype="float32", max_model_len=64)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_an_unserved_kv_cache_dtype_is_an_error_naming_it(ckpts):
    with pytest.raises(ConfigError, match="kv_cache_dtype 'fp8_e5m2' is not one of auto, fp8, fp8_e4m3"):
        make_engine(ckpts["src"], kv_cache_dtype="fp8_e5m2")


def test_unknown_method_is_an_error_before_loading(ckpts):
    with pytest.raises(QuantizationError, match="quantization='fp9'.*did you mean 'fp8'"):
        make_engine(ckpts["src"], quantization="fp9")


def test_requested_method_must_match_the_checkpoints(ckpts):
    with pytest.raises(QuantizationError, match="'compressed-tensors' was requested but the checkpoint is quantized "
                                                "with 'fp8'"):
        make_engine(ckpts["block"], quantization="compressed-tensors")


def test_online_needs_a_method_that_can(ckpts):
    with pytest.raises(QuantizationError, match="'compressed-tensors' needs a checkpoint quantized with it"):
        make_engine(ckpts["src"], quantization="compressed-tensors")


@pytest.mark.parametrize("raw,match", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_bits": 8}, r"does not act on: \['weight_bits'\]"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2' is not served"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "need activation_scheme"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
    ({"quant_method": "fp8", "activation_scheme": "minmax"}, "activation_scheme 'minmax'"),
])
def test_fp8_config_fields(raw, match):
    with pytest.raises(QuantizationError, match=match):
        Fp8Config.from_config(raw)


def _ct(weights=None, acts=None, **top):
    w = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False, **(weights or {})}
    a = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True, **(acts or {})}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": a}}, **top}


@pytest.mark.parametrize("raw,match", [
    (_ct(weights={"num_bits": 4, "type": "int"}), "num_bits=4, type='int' are not served"),
    (_ct(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme is not served"),
    (_ct(acts={"strategy": "tensor"}), "dynamic=True, strategy='tensor'"),
    (_ct(weights={"strategy": "group"}), "weight strategy 'group'"),
    (_ct(weights={"zero_point_dtype": "int8"}), r"does not act on: \['zero_point_dtype'\]"),
    (_ct(format="pack-quantized"), "format 'pack-quantized'"),
])
def test_compressed_tensors_unsupported_schemes(raw, match):
    with pytest.raises(QuantizationError, match=match):
        CompressedTensorsConfig.from_config(raw)


def test_ignored_layers_stay_dense_and_a_half_ignored_fused_layer_is_an_error(ckpts, tmp_path):
    skip_o = quantize_checkpoint(ckpts["src"], tmp_path / "skip_o", "fp8-block", block=(16, 16),
                                 skip=lambda n: ".o_proj." in n)
    engine = make_engine(skip_o)
    attn = engine.core.worker.runner.model.model.layers[0].self_attn
    assert attn.o_proj.quant_method is None and attn.qkv_proj.quant_method is not None
    skip_q = quantize_checkpoint(ckpts["src"], tmp_path / "skip_q", "fp8-block", block=(16, 16),
                                 skip=lambda n: ".q_proj." in n)
    with pytest.raises(QuantizationError, match="fused layer model.layers.0.self_attn.qkv_proj packs"):
        make_engine(skip_q)


def test_a_quantized_checkpoint_with_a_tensor_of_the_wrong_layout_fails_loudly(ckpts, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ckpts["block"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [32, 32]  # scales were written for 16x16 blocks
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightLoadError, match="weight_scale_inv"):
        make_engine(bad)


def test_dummy_weights_fill_fp8_layers(ckpts):
    import torch

    engine = make_engine(ckpts["block"], load_format="dummy")
    qkv = engine.core.worker.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and bool(torch.isfinite(qkv.weight.float()).all())
    assert bool((qkv.weight_scale_inv == 1).all())


@pytest.mark.parametrize("raw,match", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits=8 is not served"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size 100"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "lm_head": True}, "quantized lm_head"),
    ({"quant_method": "gptq", "bits": 4, "zero_offset": 1}, r"does not act on: \['zero_offset'\]"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point=false"),
])
def test_int4_config_fields(raw, match):
    from keel_quantization.awq import AWQConfig
    from keel_quantization.gptq import GPTQConfig

    cls = GPTQConfig if raw["quant_method"] == "gptq" else AWQConfig
    with pytest.raises(QuantizationError, match=match):
        cls.from_config(raw)


@pytest.mark.parametrize("layout", ["gptq", "awq"])
def test_int4_module_lists_leave_layers_dense(ckpts, tmp_path, layout):
    # GPTQ names the quantized modules (modules_in_block_to_quantize), AWQ the others (modules_to_not_convert).
    path = quantize_checkpoint(ckpts["src"], tmp_path / layout, layout, group_size=32, sym=False,
                               skip=lambda n: ".down_proj." in n)
    mlp = make_engine(path).core.worker.runner.model.model.layers[0].mlp
    assert mlp.down_proj.quant_method is None and mlp.gate_up_proj.quant_method is not None


def test_routed_experts_methods_per_config():
    import torch
    from keel_quantization.fp8_moe import Fp8MoEMethod
    from keel_quantization.gptq import GPTQConfig
    from keel_quantization.int4_moe import Int4MoEMethod

    from keel.quantization import MoELayerSpec

    spec = MoELayerSpec("model.layers.1.mlp.experts", 4, 4, 64, 32, torch.float32)
    block = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [16, 16]})
    assert isinstance(block.get_moe_method(spec), Fp8MoEMethod)
    with pytest.raises(QuantizationError, match=r"routed experts of model\.layers\.1\.mlp\.experts .*block FP8"):
        Fp8Config.from_config({"quant_method": "fp8"}).get_moe_method(spec)
    assert Fp8Config.from_online().get_moe_method(spec) is None  # online fp8: dense experts (logged)
    every = [f"model.layers.1.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    skipped = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [16, 16], "ignored_layers": every})
    assert skipped.get_moe_method(spec) is None
    partly = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [16, 16], "ignored_layers": every[:3]})
    with pytest.raises(QuantizationError, match="only some are left unquantized"):
        partly.get_moe_method(spec)
    gptq = GPTQConfig.from_config({"quant_method": "gptq", "bits": 4, "group_size": 32})
    assert isinstance(gptq.get_moe_method(spec), Int4MoEMethod)
