"""End-to-end fidelity on the CPU: keel's engine against transformers on the same random weights.

Greedy tokens must equal a plain full-recompute greedy loop in transformers, and every returned logprob
must match transformers' log-softmax in float32 within 1e-4 -- for prompts of different lengths submitted
together and at staggered times, with chunked prefill, preemption and prefix-cache hits.
"""

from __future__ import annotations

import random

import pytest

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.checkpoints import make_checkpoint
from keel.testing.fidelity import assert_matches_hf, run_requests

ATOL = 1e-4
ARCH_OVERRIDES = {
    "llama": {
        "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    },
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_checkpoint(arch, root / arch, **kw) for arch, kw in ARCH_OVERRIDES.items()}


def make_engine(path, **kw) -> LLMEngine:
    args = {"model": str(path), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 4,
                "max_model_len": 128, "seed": 0}
    args.update(kw)
    return LLMEngine.from_engine_args(EngineArgs(**args))


def prompts_for(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def run_staggered(engine: LLMEngine, prompts, params, stagger: int = 0):
    return run_requests(engine, prompts, params, stagger=stagger)


def check_against_hf(path, prompts, results, max_tokens):
    assert_matches_hf(path, prompts, results, max_tokens, atol=ATOL)


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("arch", list(ARCH_OVERRIDES))
def test_batch_submitted_together(checkpoints, arch):
    path = checkpoints[arch]
    prompts = prompts_for(1, [5, 17, 9, 30])
    results = run_staggered(make_engine(path), prompts, GREEDY)
    check_against_hf(path, prompts, results, 8)


def test_staggered_arrivals_and_chunked_prefill(checkpoints):
    path = checkpoints["llama"]
    prompts = prompts_for(2, [23, 4, 41, 12, 7])
    engine = make_engine(path, max_num_batched_tokens=16)  # forces chunked prefill of long prompts
    results = run_staggered(engine, prompts, GREEDY, stagger=2)
    check_against_hf(path, prompts, results, 8)


def test_preemption_keeps_outputs(checkpoints):
    path = checkpoints["qwen2"]
    prompts = prompts_for(3, [10, 14, 9, 12, 11, 13])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    engine = make_engine(path, num_kv_blocks=16, max_model_len=48)  # 15 usable blocks of 4 tokens
    results = run_staggered(engine, prompts, params)
    assert engine.get_metrics()["num_preemptions_total"] > 0
    check_against_hf(path, prompts, results, 12)
    assert engine.get_metrics()["kv_cache_usage"] == 0.0


def test_prefix_cache_hits_compute_only_new_tokens(checkpoints):
    path = checkpoints["qwen3"]
    shared = prompts_for(4, [16])[0]
    prompts = [shared + [5, 6, 7], shared + [8, 9]]
    engine = make_engine(path)
    first = run_staggered(engine, prompts[:1], GREEDY)
    m0 = engine.get_metrics()
    second = run_staggered(engine, prompts[1:], GREEDY)
    m1 = engine.get_metrics()
    hits = m1["prefix_cache_hits_total"] - m0["prefix_cache_hits_total"]
    assert hits == 16  # four full blocks of the shared prefix
    assert second["0"].num_cached_tokens == 16
    check_against_hf(path, prompts[:1], first, 8)
    check_against_hf(path, prompts[1:], second, 8)


def test_outputs_identical_with_and_without_chunking_preemption_caching(checkpoints):
    path = checkpoints["mistral"]
    prompts = prompts_for(5, [19, 6, 25, 11])
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    base = run_staggered(make_engine(path, enable_prefix_caching=False, max_num_batched_tokens=256), prompts,
                         params)
    stressed = run_staggered(
        make_engine(path, max_num_batched_tokens=8, num_kv_blocks=14, max_model_len=40), prompts, params
    )
    for i in range(len(prompts)):
        assert base[str(i)].outputs[0].token_ids == stressed[str(i)].outputs[0].token_ids


def test_shared_experts_fusion_flag_is_refused_without_moe_layers(checkpoints):
    with pytest.raises(NotImplementedError, match="disable_shared_experts_fusion is set, but .* no MoE layers"):
        make_engine(checkpoints["qwen2"], disable_shared_experts_fusion=True)
