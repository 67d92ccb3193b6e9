"""Speculative decoding (n-gram drafts, tiny Llama) with async scheduling: step N+1 is scheduled before
step N's accepted counts are applied, counting N's drafts as accepted; the runner corrects (here on the
host: the n-gram proposer reads token history, so each step waits for the previous one).

Outputs must equal speculative decoding without async scheduling and plain decoding -- greedy, seeded
random, penalties, stop tokens and max_tokens inside an accepted run, logprobs, chunked prefill,
prefix hits, preemption, aborts -- and no KV block may leak.
"""

from __future__ import annotations

import pytest

from keel import LLM, SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.checkpoints import make_checkpoint
from keel.testing.fidelity import assert_spec_async_identical, run_requests, run_with_abort

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # a narrow vocabulary makes the random model repeat itself, so n-gram drafts get accepted
    return make_checkpoint("llama", tmp_path_factory.mktemp("spec-async") / "m", vocab_size=24)


def make_engine(path, spec: bool, async_scheduling: bool, **kw) -> LLMEngine:
    args = {"model": str(path), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 4,
            "max_model_len": 96, "seed": 0, "async_scheduling": async_scheduling,
            "speculative_config": NGRAM if spec else None, **kw}
    return LLMEngine.from_engine_args(EngineArgs(**args))


PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4], [7, 8, 9, 10, 7, 8], [11, 12, 13, 14, 15, 16, 17, 11, 12], [5, 5, 5],
           [20, 21, 20, 21, 20], [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 6]]
MIXED = [
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=1.0, seed=3, max_tokens=25, ignore_eos=True, logprobs=1),
    SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.3, seed=9, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # max_tokens inside a draft run
    SamplingParams(temperature=0.7, seed=5, max_tokens=30, min_tokens=3, stop_token_ids=[4, 9, 13]),
    SamplingParams(temperature=0, max_tokens=28, stop_token_ids=[15], ignore_eos=True),
]


def run_three(path, prompts, params, stagger=0, **kw):
    """Plain, speculative, speculative + async decoding: identical outputs (the async engine, its outputs)."""
    return assert_spec_async_identical(lambda spec, a: make_engine(path, spec, a, **kw), prompts, params, stagger)


def test_mixed_sampling_matches_sync_and_plain(ckpt):
    engine, got = run_three(ckpt, PROMPTS, MIXED)
    spec = engine.core.worker.runner.spec
    assert spec.num_device_fixed == 0  # a host proposer: every step first has the previous tokens
    assert spec.num_host_fixed > 0  # ... and steps were scheduled before their predecessor was applied
    # placeholders the n-gram proposer had no draft for are not counted as drafts (async verifies no more
    # drafts than sync)
    sync = make_engine(ckpt, True, False)
    run_requests(sync, PROMPTS, MIXED)
    assert engine.get_metrics()["spec_decode_num_draft_tokens_total"] <= sync.get_metrics()[
        "spec_decode_num_draft_tokens_total"]


def stop_params_from(path, prompts, max_tokens=30, min_index=4):
    """Per prompt, a stop token id that first appears at output index >= min_index of greedy decoding
    (so the stop lands after several steps, typically inside a run of accepted drafts)."""
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    base = run_requests(make_engine(path, False, False), prompts, greedy)
    params, stops = [], 0
    for i in range(len(prompts)):
        out = base[str(i)].outputs[0].token_ids
        j = next((j for j in range(min_index, len(out)) if out[j] not in out[:j]), None)
        stop_ids = [out[j]] if j is not None else []
        stops += j is not None
        params.append(SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop_ids))
    assert stops >= 2
    return params


def test_stop_tokens_inside_accepted_runs(ckpt):
    params = stop_params_from(ckpt, PROMPTS)
    engine, got = run_three(ckpt, PROMPTS, params)
    assert sum(r.outputs[0].finish_reason == "stop" for r in got.values()) >= 2
    assert engine.get_metrics()["spec_decode_num_accepted_tokens_total"] > 0


def test_chunked_prefill_prefix_hits_staggered(ckpt):
    shared = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5, 6]
    prompts = [shared + p for p in PROMPTS[:4]] + PROMPTS[4:]
    engine, got = run_three(ckpt, prompts, MIXED, stagger=2, max_num_batched_tokens=10)
    assert engine.get_metrics()["prefix_cache_hits_total"] > 0


def test_preemption(ckpt):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True, logprobs=0) for s in range(3)]
    engine, got = run_three(ckpt, PROMPTS[:3] * 2, params, num_kv_blocks=16, max_model_len=40)
    assert engine.get_metrics()["num_preemptions_total"] > 0


def test_abort_while_steps_are_in_flight(ckpt):
    engine = make_engine(ckpt, True, True)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    done = run_with_abort(engine, PROMPTS[:3], params, "1", at_step=3)
    assert "1" not in done
    assert [len(done[r].outputs[0].token_ids) for r in ("0", "2")] == [20, 20]
    assert engine.get_metrics()["kv_cache_usage"] == 0.0


def test_stop_string_inside_accepted_drafts(tmp_path):
    from keel.testing.tokenizer import build_tokenizer

    tok = build_tokenizer(tmp_path, vocab_size=512)
    make_checkpoint("llama", tmp_path, vocab_size=len(tok), bos_token_id=1, eos_token_id=2)
    common = {"model": str(tmp_path), "dtype": "float32", "max_model_len": 96, "block_size": 8, "seed": 0}
    plain = LLM(**common)
    spec = LLM(**common, speculative_config=NGRAM, async_scheduling=True)
    base = plain.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    stop = base.text[len(base.text) // 2: len(base.text) // 2 + 2]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop])
    want = plain.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
    got = spec.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    assert spec.get_metrics()["kv_cache_usage"] == 0.0
