"""Beam search for the server's `use_beam_search` requests, over the engine client (as vLLM's
`EngineClient.beam_search`): each step extends every live beam by one token through one max_tokens=1
request with 2 x beam_width logprobs (the prefix cache makes the repeated prompts cheap), keeps the best
`beam_width` by length-penalized score -- vLLM's: cumulative logprob / sequence length ** length_penalty,
prompt included, a final EOS not -- and sets a beam aside when it ends on EOS.
"""

from __future__ import annotations

import asyncio
from typing import Any

from keel.engine.beam_search import BeamSearchSequence as Beam
from keel.engine.beam_search import get_beam_search_score
from keel.engine.output_processor import RequestOutputKind
from keel.engine.outputs import CompletionOutput, RequestOutput
from keel.engine.sampling_params import SamplingParams


async def beam_search(engine: Any, prompt_ids: list[int], request_id: str, *, beam_width: int, max_tokens: int,
                      temperature: float = 0.0, length_penalty: float = 1.0, ignore_eos: bool = False,
                      with_logprobs: bool = False) -> RequestOutput:
    """The best `beam_width` sequences of `prompt_ids`, best first, as one finished RequestOutput whose
    completions hold the generated part only. Called by the openai endpoint; engine errors propagate."""
    eos = engine.processor.eos_token_id
    step = SamplingParams(max_tokens=1, logprobs=2 * beam_width, temperature=temperature)

    async def extend(beam: Beam, rid: str) -> dict[int, Any]:
        last = None
        async for out in engine.generate({"prompt_token_ids": beam.tokens}, step, rid,
                                         output_kind=RequestOutputKind.FINAL_ONLY):
            last = out
        return last.outputs[0].logprobs[0]  # type: ignore[union-attr]

    def score(beam: Beam) -> float:  # the offline LLM.beam_search's (vLLM's) length-penalized score
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos, length_penalty)

    live, done = [Beam(list(prompt_ids))], []
    for i in range(max_tokens):
        if not live:
            break
        steps = await asyncio.gather(*(extend(b, f"{request_id}-beam{i}-{j}") for j, b in enumerate(live)))
        grown = []
        for beam, entries in zip(live, steps):
            for token, lp in entries.items():
                child = Beam([*beam.tokens, token], [*beam.logprobs, entries], beam.cum_logprob + lp.logprob)
                if token == eos and not ignore_eos:
                    child.finish_reason = "stop"
                    done.append(child)
                else:
                    grown.append(child)
        live = sorted(grown, key=score, reverse=True)[:beam_width]
    for beam in live:
        beam.finish_reason = "length"
    best = sorted(done + live, key=score, reverse=True)[:beam_width]
    tok, n = engine.get_tokenizer(), len(prompt_ids)
    outputs = [CompletionOutput(k, tok.decode(b.tokens[n:]) if tok is not None else "", b.tokens[n:], b.cum_logprob,
                                b.logprobs if with_logprobs else None, b.finish_reason) for k, b in enumerate(best)]
    return RequestOutput(request_id, None, list(prompt_ids), None, outputs, True)
