"""`LLM.beam_search` (vLLM's offline beam search) against the same search run on transformers' logits."""

from __future__ import annotations

import pytest
import torch

from keel import LLM, TokensPrompt
from keel.engine.beam_search import BeamSearchParams, get_beam_search_score
from keel.engine.limits import ParamError


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, max_model_len=64, num_kv_blocks=64, block_size=8, platform="cpu", dtype="float32")


def hf_beam_search(model_dir, prompt, width, max_tokens, eos, length_penalty=1.0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    live, done = [(list(prompt), 0.0)], []

    def score(beam):
        return get_beam_search_score(beam[0], beam[1], eos, length_penalty)

    for _ in range(max_tokens):
        grown = []
        for tokens, cum in live:
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].double(), -1)
            top = torch.topk(logprobs, 2 * width)
            for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                (done if t == eos else grown).append(([*tokens, t], cum + lp))
        live = sorted(grown, key=score, reverse=True)[:width]
    return sorted(done + live, key=score, reverse=True)[:width]


@pytest.mark.parametrize("width,length_penalty", [(1, 1.0), (3, 1.0), (2, 0.5)])
def test_beams_match_transformers(llm, tiny_model_dir, width, length_penalty):
    prompts = [[5, 17, 230, 9], [300, 301]]
    params = BeamSearchParams(beam_width=width, max_tokens=5, length_penalty=length_penalty)
    outs = llm.beam_search([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    eos = llm.llm_engine.processor.eos_token_id
    for prompt, out in zip(prompts, outs):
        ref = hf_beam_search(tiny_model_dir, prompt, width, 5, eos, length_penalty)
        assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in ref]
        for seq, (_, cum) in zip(out.sequences, ref):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-3)
            assert len(seq.logprobs) == len(seq.tokens) - len(prompt)
            assert seq.text == llm.get_tokenizer().decode(seq.tokens)


def test_width_one_is_greedy(llm):
    from keel import SamplingParams

    prompt = TokensPrompt(prompt_token_ids=[7, 8, 9])
    beam = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))[0]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    assert beam.sequences[0].tokens[3:] == greedy[0].outputs[0].token_ids


@pytest.mark.parametrize("kwargs,field", [({"beam_width": 0, "max_tokens": 4}, "beam_width"),
                                          ({"beam_width": 2, "max_tokens": -1}, "max_tokens"),
                                          ({"beam_width": 2, "max_tokens": 4, "include_stop_str_in_output": True},
                                           "include_stop_str_in_output")])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ParamError, match=field):
        BeamSearchParams(**kwargs)


def test_bad_prompt_queues_nothing(llm):
    with pytest.raises(ValueError):
        llm.beam_search([TokensPrompt(prompt_token_ids=[1]), TokensPrompt(prompt_token_ids=[10**6])],
                        BeamSearchParams(beam_width=2, max_tokens=2))
    assert not llm.llm_engine.has_unfinished_requests()
