"""Async scheduling: step N+1 is scheduled and launched before step N's tokens reach the host.

Its outputs must be exactly those of the synchronous engine -- greedy and seeded sampling, logprobs,
penalties, stops, max_tokens, prompt logprobs, chunked prefill, preemption, prefix-cache hits and aborts
-- and no KV block may leak. On the CPU the device is synchronous, so these tests check the bookkeeping
(placeholders, tokens fed from the device tensor, late commits); the overlap itself is measured on the
GPU (benchmarks/h200_llama8b.py).
"""

from __future__ import annotations

import random

import pytest

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.checkpoints import make_checkpoint
from keel.testing.fidelity import run_requests, run_with_abort


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("async") / "llama", num_hidden_layers=2)


def make_engine(path, async_scheduling: bool, **kw) -> LLMEngine:
    args = {"model": str(path), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 4,
            "max_model_len": 64, "seed": 0, "async_scheduling": async_scheduling}
    args.update(kw)
    return LLMEngine.from_engine_args(EngineArgs(**args))


def prompts_for(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


MIXED = [
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.9, seed=11, max_tokens=7, ignore_eos=True, presence_penalty=0.5,
                   frequency_penalty=0.3, logprobs=1),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.8, seed=5, max_tokens=1, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=3, max_tokens=12, repetition_penalty=1.4, min_tokens=4,
                   stop_token_ids=[7, 8, 9, 10, 11, 12, 13, 14, 15, 16], prompt_logprobs=1),
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.5, seed=8, max_tokens=10, ignore_eos=True),
]


def outputs(results) -> dict:
    return {rid: [(c.token_ids, c.finish_reason, c.stop_reason) for c in r.outputs] for rid, r in results.items()}


def logprob_values(results) -> dict:
    """Logprobs as comparable floats; batch composition may differ (preemption timing), so float32
    rounding may too: compared within 1e-4, like transformers fidelity."""
    def flat(entries):
        return [(tok, lp.logprob, lp.rank) for pos in entries or [] if pos for tok, lp in sorted(pos.items())]

    return {rid: [flat(c.logprobs) for c in r.outputs] + [flat(r.prompt_logprobs)] for rid, r in results.items()}


def assert_logprobs_close(got, want) -> None:
    g, w = logprob_values(got), logprob_values(want)
    assert g.keys() == w.keys()
    for rid in g:
        for a, b in zip(g[rid], w[rid], strict=True):
            assert [(t, r) for t, _, r in a] == [(t, r) for t, _, r in b], rid
            assert all(abs(x - y) < 1e-4 for (_, x, _), (_, y, _) in zip(a, b)), rid


def run_both(path, prompts, params, stagger=0, **kw):
    sync_engine = make_engine(path, False, **kw)
    async_engine = make_engine(path, True, **kw)
    assert async_engine.core.async_scheduling and not sync_engine.core.async_scheduling
    want = run_requests(sync_engine, prompts, params, stagger=stagger)
    got = run_requests(async_engine, prompts, params, stagger=stagger)
    assert outputs(got) == outputs(want)
    assert_logprobs_close(got, want)
    runner = async_engine.core.worker.runner
    assert runner.in_flight.num_device_fed_tokens > 0, "no step ever took its input tokens from the device"
    assert async_engine.get_metrics()["kv_cache_usage"] == 0.0
    assert not async_engine.has_unfinished_requests()
    return sync_engine, async_engine


def test_mixed_sampling_matches_sync(model_path):
    prompts = prompts_for(1, [5, 17, 9, 30, 3, 12])
    run_both(model_path, prompts, MIXED)


def test_staggered_chunked_prefill_and_prefix_hits_match_sync(model_path):
    shared = prompts_for(2, [12])[0]
    prompts = [shared + p for p in prompts_for(3, [3, 21, 1, 9])] + prompts_for(4, [27])
    _, eng = run_both(model_path, prompts, MIXED[:5], stagger=2, max_num_batched_tokens=10)
    assert eng.get_metrics()["prefix_cache_hits_total"] > 0


def test_preemption_matches_sync(model_path):
    prompts = prompts_for(5, [10, 14, 9, 12, 11, 13])
    _, async_engine = run_both(model_path, prompts, MIXED, num_kv_blocks=14, max_model_len=40)
    assert async_engine.get_metrics()["num_preemptions_total"] > 0


def test_abort_while_steps_are_in_flight_frees_blocks(model_path):
    engine = make_engine(model_path, True)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    done = run_with_abort(engine, prompts_for(6, [6, 8, 5]), params, "1", at_step=4, max_steps=40)
    assert "1" not in done  # an aborted request reports nothing more (as without async scheduling)
    assert len(done["0"].outputs[0].token_ids) == 20 and len(done["2"].outputs[0].token_ids) == 20
    assert engine.get_metrics()["kv_cache_usage"] == 0.0


def test_max_tokens_is_not_overscheduled(model_path):
    """A request whose in-flight token is its last is not scheduled again (no wasted step)."""
    engine = make_engine(model_path, True)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, ignore_eos=True))
    scheduled = []
    while engine.has_unfinished_requests():
        before = engine.core.scheduler.requests.get("a")
        engine.step()
        if before is not None:
            scheduled.append(before.num_computed_tokens)
    # prefill (3 tokens) then one decode: the second sampled token is never computed as an input
    assert max(scheduled) == 4


def test_async_with_speculative_decoding_is_accepted_and_on_by_default_off_the_cpu(model_path):
    from keel.engine.core import resolve_async_scheduling

    engine = make_engine(model_path, True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert engine.core.async_scheduling  # outputs: tests/test_spec_async.py
    assert resolve_async_scheduling(None, "cuda", 1) and not resolve_async_scheduling(None, "cpu", 1)
    assert not resolve_async_scheduling(False, "cuda", 1)


def test_cpu_default_is_synchronous(model_path):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_path), skip_tokenizer_init=True,
                                                   max_model_len=32, platform="cpu"))
    assert engine.core.async_scheduling is False
