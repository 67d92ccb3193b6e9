"""MTP speculative decoding with async scheduling (tiny DeepSeek-V3 + MTP, CPU).

Step N+1 is scheduled before step N's accepted counts are applied; the runner takes N+1's bonus token
and drafts from N's device tensors and lowers its positions by N's rejected count (no host sync), or,
where the host must see N's tokens (penalties, min_tokens), waits for N first. Outputs must equal MTP
without async scheduling and plain decoding: greedy, seeded random, penalties, stop tokens and
max_tokens inside an accepted run, chunked prefill, prefix hits, preemption, aborts; no block leaks.
"""

from __future__ import annotations

import pytest
from deepseek_test_utils import random_prompts, make_mtp_checkpoint

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.fidelity import assert_spec_async_identical, run_requests, run_with_abort


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_mtp_checkpoint(tmp_path_factory.mktemp("mtp-async") / "v3")


def make_engine(path, k: int | None, async_scheduling: bool, **kw) -> LLMEngine:
    args = {"model": str(path), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 4,
            "max_model_len": 96, "seed": 0, "async_scheduling": async_scheduling, **kw}
    if k:
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
    return LLMEngine.from_engine_args(EngineArgs(**args))


PROMPTS = random_prompts([5, 17, 9, 30, 3, 12], seed=11)


def run_three(path, k, prompts, params, stagger=0, **kw):
    """Plain decoding, MTP, MTP with async scheduling: identical outputs (the async engine, its outputs)."""
    return assert_spec_async_identical(lambda spec, a: make_engine(path, k if spec else None, a, **kw), prompts,
                                       params, stagger)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_inputs_come_from_the_device(ckpt, k):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    engine, got = run_three(ckpt, k, PROMPTS, params)
    spec = engine.core.worker.runner.spec
    assert spec.num_device_fixed > 0 and spec.num_host_waits == 0


def test_sampling_mix_device_and_host_paths(ckpt):
    params = [
        SamplingParams(temperature=1.0, seed=3, max_tokens=14, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.5, top_k=8, seed=4, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.2, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),  # max_tokens inside a draft run
        SamplingParams(temperature=0.3, seed=6, min_tokens=6, max_tokens=12, stop_token_ids=[7, 8, 9, 10]),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
    ]
    engine, got = run_three(ckpt, 3, PROMPTS, params)
    spec = engine.core.worker.runner.spec
    assert spec.num_device_fixed > 0 and spec.num_host_waits > 0  # penalties / min_tokens wait


def test_stop_tokens_inside_accepted_runs(ckpt):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = run_requests(make_engine(ckpt, None, False), PROMPTS, greedy)
    params = []
    for i in range(len(PROMPTS)):
        out = base[str(i)].outputs[0].token_ids
        j = next((j for j in range(4, len(out)) if out[j] not in out[:j]), None)
        params.append(SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                     stop_token_ids=[out[j]] if j is not None else []))
    engine, got = run_three(ckpt, 3, PROMPTS, params)
    assert sum(r.outputs[0].finish_reason == "stop" for r in got.values()) >= 2


def test_chunked_prefill_and_prefix_hits(ckpt):
    shared = random_prompts([13], seed=2)[0]
    prompts = [shared + p for p in random_prompts([3, 21, 1, 9], seed=3)] + random_prompts([27], seed=4)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)]
    engine, got = run_three(ckpt, 2, prompts, params, stagger=2, max_num_batched_tokens=10)
    assert engine.get_metrics()["prefix_cache_hits_total"] > 0


def test_preemption(ckpt):
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=18, ignore_eos=True) for s in range(3)]
    engine, got = run_three(ckpt, 3, PROMPTS, params, num_kv_blocks=20, max_model_len=48)
    assert engine.get_metrics()["num_preemptions_total"] > 0


def test_abort_while_steps_are_in_flight(ckpt):
    engine = make_engine(ckpt, 3, True)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    done = run_with_abort(engine, PROMPTS[:3], params, "1", at_step=3)
    assert "1" not in done
    assert [len(done[r].outputs[0].token_ids) for r in ("0", "2")] == [16, 16]
    assert engine.get_metrics()["kv_cache_usage"] == 0.0
