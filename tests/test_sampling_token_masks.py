"""`allowed_token_ids` and `bad_words` (vLLM's SamplingParams fields): validation, the ban rule, and the
engine honouring them in greedy, random and speculative-free async steps, identically to sync steps."""

from __future__ import annotations

import pytest

from keel import LLM, SamplingParams
from keel.layers.bad_words import banned_by_bad_words

pytest.importorskip("keel_endpoints")
from keel_endpoints.testing import make_tiny_model  # noqa: E402


def test_validation():
    for bad in ([], [-1], ["a"], 3):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    for bad in ([""], [" "], "word", [3]):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)


def test_ban_rule():
    words = [[5], [7, 8], [1, 2, 3]]
    assert banned_by_bad_words(words, []) == [5]
    assert banned_by_bad_words(words, [9, 7]) == [5, 8]
    assert banned_by_bad_words(words, [1, 2]) == [5, 3]
    assert banned_by_bad_words(words, [2, 1]) == [5]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("masks"))


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_honours_allowed_tokens_and_bad_words(model_dir, async_scheduling):
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, block_size=8, seed=0,
              async_scheduling=async_scheduling)
    tok = llm.get_tokenizer()
    prompts = ["Hello", "The quick brown fox", "Numbers: 1 2 3"]
    free = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    # Ban a word the greedy output actually writes (its first two-token piece).
    first = free[1].outputs[0].token_ids
    word = tok.decode(first[2:4]).strip() or "the"
    allowed = [5, 9, 40, 41, 300]
    params = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, bad_words=[word]),
        SamplingParams(max_tokens=24, temperature=1.0, seed=4, ignore_eos=True, allowed_token_ids=allowed),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    ]
    outs = llm.generate([prompts[1], prompts[0], prompts[2]], params, use_tqdm=False)
    ids = params[0].clone()
    ids.update_from_tokenizer(tok)
    assert ids.bad_words_token_ids and params[0].bad_words_token_ids == []  # the user's object is untouched
    assert not any(contains(list(outs[0].outputs[0].token_ids), w) for w in ids.bad_words_token_ids)
    assert set(outs[1].outputs[0].token_ids) <= set(allowed)
    assert outs[2].outputs[0].token_ids == free[2].outputs[0].token_ids  # the neighbour is untouched
    llm.llm_engine.shutdown()


def test_out_of_vocabulary_allowed_ids_are_refused(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=64, block_size=8)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["Hi"], SamplingParams(allowed_token_ids=[1, 10_000]), use_tqdm=False)
