"""Offline beam search (`LLM.beam_search`), as vLLM's: each step extends every live beam by one token
through `LLM.generate` (max_tokens=1 with 2 x beam_width logprobs), keeps the best `beam_width` per
prompt by length-penalized score, and sets a beam aside when it ends on EOS. The prefix cache makes the
repeated prompts cheap. Names and scoring follow vllm.beam_search.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from keel.engine.limits import ParamError
from keel.engine.outputs import Logprob
from keel.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from keel.engine.llm import LLM, PromptType


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParamError(name, f"{name} must be a positive integer, got {value!r}")
        if self.include_stop_str_in_output:
            raise ParamError("include_stop_str_in_output", "include_stop_str_in_output: beam search has no stop strings; leave it False")


@dataclass
class BeamSearchSequence:
    """One beam: prompt and generated `tokens`, one logprobs dict per generated token; `text` decodes
    `tokens` (prompt included, as vLLM's)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: Sequence[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's score: the cumulative logprob over the sequence length (prompt included, a final EOS not)
    to the power `length_penalty`."""
    seq_len = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cumulative_logprob / (seq_len ** length_penalty)


def beam_search(llm: LLM, prompts: Sequence[PromptType], params: BeamSearchParams,
                use_tqdm: bool = False) -> list[BeamSearchOutput]:
    engine = llm.llm_engine
    eos = engine.processor.eos_token_id
    tokenizer = llm.get_tokenizer()
    starts = [engine.processor.process_prompt(p).prompt_token_ids for p in prompts]  # all checked first
    step_params = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature)

    def score(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

    live: list[list[BeamSearchSequence]] = [[BeamSearchSequence(tokens=list(s))] for s in starts]
    done: list[list[BeamSearchSequence]] = [[] for _ in starts]
    for _ in range(params.max_tokens):
        flat = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not flat:
            break
        outs = llm.generate([{"prompt_token_ids": beam.tokens} for _, beam in flat], step_params, use_tqdm=use_tqdm)
        grown: list[list[BeamSearchSequence]] = [[] for _ in starts]
        for (i, beam), out in zip(flat, outs):
            step = out.outputs[0].logprobs[0]
            for token_id, lp in step.items():
                child = BeamSearchSequence(tokens=[*beam.tokens, token_id], logprobs=[*beam.logprobs, step],
                                           cum_logprob=beam.cum_logprob + lp.logprob)
                if token_id == eos and not params.ignore_eos:
                    child.finish_reason = "stop"
                    done[i].append(child)
                else:
                    grown[i].append(child)
        live = [sorted(g, key=score, reverse=True)[: params.beam_width] for g in grown]
    outputs = []
    for i in range(len(starts)):
        for beam in live[i]:
            beam.finish_reason = "length"
        best = sorted(done[i] + live[i], key=score, reverse=True)[: params.beam_width]
        for beam in best:
            if tokenizer is not None:  # the whole sequence, prompt included, as vLLM's
                beam.text = tokenizer.decode(beam.tokens)
        outputs.append(BeamSearchOutput(sequences=best))
    return outputs
