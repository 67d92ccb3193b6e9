"""End to end through keel's engine with kernels-triton's whole MoE path interpreted on the CPU (bound by
the worker as on CUDA): the routing kernel, the alignment kernel and the grouped GEMMs, against
transformers (greedy tokens, logprobs 1e-4)."""

from __future__ import annotations

import pytest
from deepseek_test_utils import make_deepseek_checkpoint, random_prompts
from keel_kernels_triton.fused_moe import align, ops
from keel_platform_cpu.platform import CpuPlatform

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.fidelity import assert_matches_hf, run_requests

CASES = {  # shared experts fused: two (V2) and one (V3)
    "v2_group_limited": (2, {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                             "routed_scaling_factor": 1.5, "n_shared_experts": 2}),  # HF ignores norm_topk_prob
    "v3": (3, {"norm_topk_prob": True, "routed_scaling_factor": 2.5}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_engine_with_triton_routing_and_align(tmp_path, monkeypatch, name):
    version, overrides = CASES[name]
    path = make_deepseek_checkpoint(version, tmp_path / name, **overrides)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(CpuPlatform, "use_custom_ops", lambda self: True)
    calls = {"route": 0, "align": 0}

    def spy(key, fn):
        def wrapped(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(ops, "select_experts_triton", spy("route", ops.select_experts_triton))
    monkeypatch.setattr(align, "moe_align_block_size_triton", spy("align", align.moe_align_block_size_triton))
    args = EngineArgs(model=str(path), skip_tokenizer_init=True, dtype="float32", block_size=4, max_model_len=64,
                      seed=0, max_num_batched_tokens=48,
                      plugins=["platform-cpu", "attention-torch", "models-deepseek", "kernels-triton"])
    # the 41-token first step runs the shared experts dense, the decode steps through the grouped GEMM
    prompts = random_prompts([38, 3], seed=6)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)
    results = run_requests(LLMEngine.from_engine_args(args), prompts, params)
    assert calls["route"] > 0 and calls["align"] == calls["route"]  # every MoE call used both kernels
    assert_matches_hf(path, prompts, results, 3, atol=1e-4)


QUANT_CASES = {  # layout, quantizer options, logprob tolerance vs transformers on the dequantized weights
    "fp8-block": ("fp8-block", {"block": (16, 16)}, 0.6),  # activations quantized per token group
    "gptq-g32-asym": ("gptq", {"group_size": 32, "sym": False}, 1e-4),  # weight-only
}


@pytest.mark.parametrize("name", list(QUANT_CASES))
def test_engine_with_quantized_experts_in_the_triton_grouped_gemm(tmp_path, monkeypatch, name):
    """The experts stay quantized and the bound kernel dequantizes them inside its grouped GEMMs; its
    tokens and logprobs match the reference path of the same checkpoint (1e-3) and transformers on the
    dequantized weights (the method's tolerance)."""
    from keel_quantization.quantizer import quantize_checkpoint

    from keel.testing.fidelity import assert_close_to_hf

    layout, options, atol = QUANT_CASES[name]
    src = make_deepseek_checkpoint(3, tmp_path / "src")
    q = quantize_checkpoint(src, tmp_path / "q", layout, dequantized_to=tmp_path / "ref", **options)
    prompts = random_prompts([7, 3], seed=6)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)
    kw = {"model": str(q), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 4, "max_model_len": 64,
          "seed": 0, "max_num_batched_tokens": 8,
          "plugins": ["platform-cpu", "attention-torch", "models-deepseek", "kernels-triton", "quantization"]}
    reference = run_requests(LLMEngine.from_engine_args(EngineArgs(**kw)), prompts, params)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(CpuPlatform, "use_custom_ops", lambda self: True)
    calls = []
    original = ops.fused_experts_quant_triton
    monkeypatch.setattr(ops, "fused_experts_quant_triton", lambda *a, **k: calls.append(a[-1].kind) or original(*a, **k))
    results = run_requests(LLMEngine.from_engine_args(EngineArgs(**kw)), prompts, params)
    assert calls and set(calls) == {"fp8_block" if layout == "fp8-block" else "int4"}
    for key, out in results.items():
        ref = reference[key].outputs[0]
        assert list(out.outputs[0].token_ids) == list(ref.token_ids)
        got = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
        want = [d[t].logprob for d, t in zip(ref.logprobs, ref.token_ids)]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3
    assert_close_to_hf(tmp_path / "ref", prompts, results, atol=atol, min_margin=0.5)
