"""FP8 KV cache (`kv_cache_dtype="fp8"`: e4m3 storage, unit scales) in the torch reference backends:
the cache holds half the bytes per block (so twice the blocks fit a budget), attention reads it back
upcast, and outputs stay close to transformers (keys and values rounded to e4m3: logprobs within 0.3
on the sharpened tiny models, greedy tokens equal where transformers' top-2 margin exceeds 0.5),
through chunked prefill, preemption and prefix hits. Backends that cannot read fp8 caches refuse
the layer by name."""

from __future__ import annotations

import pytest
import torch
from keel_quantization.quantizer import quantize_checkpoint
from quant_test_utils import GREEDY, check_layout, float_llama, make_engine, prompts_for

from keel.attention.selector import AttentionBackendError
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


def test_backends_without_fp8_caches_refuse_by_name(source):
    with pytest.raises(AttentionBackendError, match="triton_flash.*KV cache dtype torch.float8_e4m3fn not supported"):
        make_engine(source, kv_cache_dtype="fp8", attention_backend="triton_flash", block_size=16)
