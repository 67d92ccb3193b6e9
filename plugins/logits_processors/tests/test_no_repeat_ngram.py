"""`no_repeat_ngram`: the tokens it bans are transformers' `NoRepeatNGramLogitsProcessor`'s, and the
engine with it decodes exactly like a transformers greedy loop with that processor -- per request (by
`extra_args`), in a batch mix with requests that do not ask for it, with chunked prefill and with async
scheduling."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor as HFNoRepeat

from keel import LLM, SamplingParams
from keel.testing.checkpoints import make_checkpoint
from keel.testing.fidelity import load_hf
from keel.testing.tokenizer import build_tokenizer
from keel_logits_processors.no_repeat_ngram import NoRepeatNGramLogitsProcessor, _Row

VOCAB = 512


def hf_banned(seq: list[int], n: int) -> set[int]:
    scores = HFNoRepeat(n)(torch.tensor([seq]), torch.zeros(1, VOCAB))
    return set(torch.nonzero(scores[0].isinf()).flatten().tolist())


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_bans_match_transformers_as_the_output_grows(n):
    rng = random.Random(n)
    for _ in range(20):
        prompt = [rng.randrange(6) for _ in range(rng.randrange(0, 9))]  # a small alphabet repeats n-grams
        output: list[int] = []
        row = _Row(n, prompt, output)
        for _ in range(12):
            if prompt or output:
                assert row.banned() == hf_banned(prompt + output, n)
            for _ in range(rng.randrange(1, 3)):  # one token per step, or two (a step not seen)
                output.append(rng.randrange(6))


def test_validate_params_names_the_argument():
    NoRepeatNGramLogitsProcessor.validate_params(SamplingParams(extra_args={"no_repeat_ngram_size": 3}))
    for bad in (0, -1, "2", 2.0, 10**6):
        with pytest.raises(ValueError, match="extra_args.no_repeat_ngram_size"):
            NoRepeatNGramLogitsProcessor.validate_params(SamplingParams(extra_args={"no_repeat_ngram_size": bad}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ngram")
    make_checkpoint("llama", path, vocab_size=VOCAB)
    build_tokenizer(path, vocab_size=VOCAB)
    return path


def hf_greedy_no_repeat(model, prompt: list[int], max_tokens: int, n: int | None) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[:, -1].float()
            if n:
                logits = HFNoRepeat(n)(torch.tensor([ids]), logits)
            ids.append(int(logits[0].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_matches_transformers_greedy(model_dir, async_scheduling):
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(k)] for k in (5, 23, 9, 14)]
    sizes = [2, None, 3, 1]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                             extra_args={"no_repeat_ngram_size": n} if n else None) for n in sizes]
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=64, block_size=8, seed=0,
              max_num_batched_tokens=16, async_scheduling=async_scheduling,  # chunked prefill: rows come and go
              logits_processors=["no_repeat_ngram"])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.shutdown()
    hf = load_hf(model_dir)
    plain = [hf_greedy_no_repeat(hf, p, 16, None) for p in prompts]
    for out, prompt, n, free in zip(outs, prompts, sizes, plain, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy_no_repeat(hf, prompt, 16, n)
    changed = [list(o.outputs[0].token_ids) != f for o, f, n in zip(outs, plain, sizes) if n]
    assert any(changed)  # the processor mattered for this model (random weights repeat themselves)


def test_qualified_class_name_and_sampled_requests(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=64, block_size=8, seed=0,
              logits_processors=["keel_logits_processors.no_repeat_ngram:NoRepeatNGramLogitsProcessor"])
    params = SamplingParams(n=3, max_tokens=24, temperature=1.0, seed=5, ignore_eos=True,
                            extra_args={"no_repeat_ngram_size": 2})
    (out,) = llm.generate([{"prompt_token_ids": [3, 4, 3, 5]}], params, use_tqdm=False)
    for choice in out.outputs:
        seq = [3, 4, 3, 5] + list(choice.token_ids)
        grams = [tuple(seq[i:i + 2]) for i in range(len(seq) - 1)]
        assert len(grams) == len(set(grams))
    llm.llm_engine.shutdown()
