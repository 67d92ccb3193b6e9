"""Speculative decoding (n-gram drafts): one target step verifies all drafts; outputs are identical to
non-speculative decoding (greedy and seeded random), rejected drafts are rolled back and never reach the
prefix cache, and the draft/accept counters move."""

from __future__ import annotations

import pytest

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # a narrow vocabulary makes the random model repeat itself, so n-gram drafts get accepted
    return make_checkpoint("llama", tmp_path_factory.mktemp("spec") / "m", vocab_size=24)


def engine(path, spec: bool, **kw) -> LLMEngine:
    args = {"model": str(path), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 4, "max_model_len": 96}
    if spec:
        args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3,
                                      "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    args.update(kw)
    return LLMEngine.from_engine_args(EngineArgs(**args))


def run(eng, prompts, params):
    for i, p in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": p}, params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[str(i)] for i in range(len(prompts))]


PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4], [7, 8, 9, 10, 7, 8], [11, 12, 13, 14, 15, 16, 17, 11, 12], [5, 5, 5]]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True, logprobs=1),
    SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.3, seed=9, max_tokens=30, ignore_eos=True),
], ids=["greedy", "random", "penalties"])
def test_outputs_identical_to_non_speculative(ckpt, params):
    base = run(engine(ckpt, False), PROMPTS, params)
    eng = engine(ckpt, True)
    spec = run(eng, PROMPTS, params)
    for a, b in zip(base, spec):
        assert a.token_ids == b.token_ids
        if params.logprobs is not None:
            for da, db in zip(a.logprobs, b.logprobs):
                assert da.keys() == db.keys()
                for t in da:
                    assert abs(da[t].logprob - db[t].logprob) < 1e-4 and da[t].rank == db[t].rank
    m = eng.get_metrics()
    assert m["spec_decode_num_draft_tokens_total"] > 0
    assert 0 < m["spec_decode_num_accepted_tokens_total"] <= m["spec_decode_num_draft_tokens_total"]
    assert m["kv_cache_usage"] == 0.0


def test_distribution_unchanged_over_many_seeds(ckpt):
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=6, ignore_eos=True) for s in range(40)]
    base_eng, spec_eng = engine(ckpt, False), engine(ckpt, True)
    for p in params:
        assert run(base_eng, [prompt], p)[0].token_ids == run(spec_eng, [prompt], p)[0].token_ids
    m = spec_eng.get_metrics()
    assert m["spec_decode_num_accepted_tokens_total"] < m["spec_decode_num_draft_tokens_total"]  # rejections happened


def test_rejected_drafts_never_enter_prefix_cache_and_preemption(ckpt):
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=24, ignore_eos=True, logprobs=0)
    # small pool: preemption while drafts are in flight
    eng = engine(ckpt, True, num_kv_blocks=14, max_model_len=40)
    first = run(eng, PROMPTS[:3], params)
    assert eng.get_metrics()["num_preemptions_total"] > 0
    assert eng.get_metrics()["spec_decode_num_accepted_tokens_total"] < eng.get_metrics()[
        "spec_decode_num_draft_tokens_total"]
    base = run(engine(ckpt, False, num_kv_blocks=14, max_model_len=40), PROMPTS[:3], params)
    assert [o.token_ids for o in first] == [o.token_ids for o in base]
    # committed tokens as a new prompt: every cached block it hits must hold exactly those tokens
    follow = [PROMPTS[i] + first[i].token_ids[:12] for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    hits_before = eng.get_metrics()["prefix_cache_hits_total"]
    cached = run(eng, follow, greedy)
    assert eng.get_metrics()["prefix_cache_hits_total"] > hits_before
    fresh = run(engine(ckpt, False, enable_prefix_caching=False), follow, greedy)
    for a, b in zip(cached, fresh):
        assert a.token_ids == b.token_ids
        for da, db in zip(a.logprobs, b.logprobs):
            t = next(iter(db))
            assert abs(da[t].logprob - db[t].logprob) < 1e-4



def test_drafts_not_cut_at_max_tokens():
    """A request near its max_tokens verifies every draft that fits in max_model_len (as vLLM), so a
    batch keeps one query length and its CUDA graph; what is accepted past max_tokens is dropped."""
    import torch

    from keel.engine.request import EngineCoreRequest
    from keel.engine.scheduler import Scheduler
    from keel.engine.scheduler_output import ModelRunnerOutput
    from keel.kv_cache.manager import KVCacheManager
    from keel.kv_cache.spec import FullAttentionSpec

    kv = KVCacheManager(FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype=torch.float32),
                        num_blocks=32, enable_caching=False)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=12, num_spec_tokens=3)
    s.add_request(EngineCoreRequest("a", [1, 2, 3, 4], SamplingParams(max_tokens=3, ignore_eos=True),
                                    eos_token_id=None, seed=0), 3)
    out = s.schedule()  # the prompt; the proposer drafts three tokens, two more than max_tokens leaves
    s.update_from_output(out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7]],
                                                spec_token_ids={"a": [8, 9, 10]}))
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens["a"] == [8, 9, 10]
    (done,) = s.update_from_output(out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[8, 9, 10, 11]]))
    assert done.new_token_ids == [8, 9] and done.finish_reason == "length"
    # max_model_len still bounds them
    s.add_request(EngineCoreRequest("b", list(range(1, 10)), SamplingParams(max_tokens=3, ignore_eos=True),
                                    eos_token_id=None, seed=0), 3)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(req_ids=["b"], sampled_token_ids=[[7]],
                                                spec_token_ids={"b": [8, 9, 10]}))
    assert s.schedule().scheduled_spec_decode_tokens["b"] == [8, 9]  # 10 tokens + 2 drafts: max_model_len 12
