"""FP8 KV cache (`kv_cache_dtype="fp8"`: e4m3 storage) in the torch reference backends:
the cache holds half the bytes per block (so twice the blocks fit a budget), attention reads it back
upcast, and outputs stay close to transformers (keys and values rounded to e4m3: logprobs within 0.3
on the sharpened tiny models, greedy tokens equal where transformers' top-2 margin exceeds 0.5),
through chunked prefill, preemption and prefix hits. Per-layer `k_scale` / `v_scale` from the
checkpoint load (range-checked); 1.0 without them. (triton_flash / triton_mla: their own tests.)"""

from __future__ import annotations

import pytest
import torch
from keel_quantization.quantizer import quantize_checkpoint
from quant_test_utils import GREEDY, check_layout, float_llama, make_engine, prompts_for

from keel.testing.fidelity import assert_close_to_hf, run_requests

TOLERANCE = (0.3, 0.5)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return float_llama(tmp_path_factory.mktemp("kv") / "llama")


def test_fp8_cache_halves_the_pages(source):
    auto = make_engine(source, num_kv_blocks=40)
    fp8 = make_engine(source, num_kv_blocks=40, kv_cache_dtype="fp8")
    runner_auto, runner_fp8 = auto.core.worker.runner, fp8.core.worker.runner
    assert runner_fp8.kv_cache_bytes_per_block() * 4 == runner_auto.kv_cache_bytes_per_block()  # float32 -> 1 byte
    assert all(c.dtype == torch.float8_e4m3fn for c in runner_fp8.kv_caches)
    budget = 64 * runner_auto.kv_cache_bytes_per_block()
    sized_auto = make_engine(source, kv_cache_memory_bytes=budget).core.worker.num_blocks
    sized_fp8 = make_engine(source, kv_cache_memory_bytes=budget, kv_cache_dtype="fp8_e4m3").core.worker.num_blocks
    assert sized_fp8 == 4 * sized_auto


def test_fp8_cache_llama_close_to_transformers(source, tmp_path):
    prompts = prompts_for(21, [5, 17, 9, 30])
    results = run_requests(make_engine(source, kv_cache_dtype="fp8"), prompts, GREEDY)
    assert_close_to_hf(source, prompts, results, atol=TOLERANCE[0], min_margin=TOLERANCE[1])


def test_fp8_cache_with_fp8_weights_through_stress(source, tmp_path):
    quantized = quantize_checkpoint(source, tmp_path / "q", "ct-fp8-channel", weight_only=True,
                                    dequantized_to=tmp_path / "ref")
    check_layout(quantized, tmp_path / "ref", TOLERANCE, kv_cache_dtype="fp8")


def test_checkpoint_kv_scales_load_and_are_range_checked(source, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from keel.models.weights import WeightLoadError

    def with_scales(name, k, v):
        path = tmp_path / name
        shutil.copytree(source, path)
        w = load_file(str(path / "model.safetensors"))
        w["model.layers.0.self_attn.k_scale"], w["model.layers.0.self_attn.v_scale"] = torch.tensor(k), torch.tensor(v)
        save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path

    attn = make_engine(with_scales("ok", 0.25, 0.5), kv_cache_dtype="fp8").core.worker.runner.attn_layers[0]
    assert (float(attn.k_scale), float(attn.v_scale)) == (0.25, 0.5)
    assert float(make_engine(source, kv_cache_dtype="fp8").core.worker.runner.attn_layers[0].k_scale) == 1.0
    with pytest.raises(WeightLoadError, match="k_scale.*finite positive number"):
        make_engine(with_scales("bad", -1.0, 0.5), kv_cache_dtype="fp8")
