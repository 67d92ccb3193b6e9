"""The "completion" IO processor: /v1/completions bodies <-> engine prompts and OpenAI responses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keel.engine.outputs import RequestOutput
from keel.engine.sampling_params import SamplingParams
from keel.io import EnginePrompt
from keel_io_processors.base import OpenAIProcessorBase, StreamBase, prompt_logprobs_json, usage
from keel_io_processors.logprobs import CompletionLogprobs
from keel_io_processors.protocol import CompletionRequest, InvalidRequestError, validate
from keel_io_processors.sampling import build_sampling_params


class CompletionProcessor(OpenAIProcessorBase):
    """`prompt` may be a string, a list of strings, a list of token ids or a list of such lists; each
    prompt becomes one engine request, and choice `index` is `prompt_index * n + sample_index`."""

    request_model = CompletionRequest

    def parse_request(self, payload: Any) -> CompletionRequest:
        request = validate(CompletionRequest, payload, "cmpl")
        if request.suffix is not None:
            raise InvalidRequestError("suffix is not supported", "suffix")
        if request.best_of is not None and request.best_of < request.n:
            raise InvalidRequestError(f"best_of ({request.best_of}) must be at least n ({request.n})", "best_of")
        if request.best_of is not None and request.best_of > request.n and request.stream:
            raise InvalidRequestError("best_of cannot be used with stream: the best completions are only "
                                      "known at the end", "best_of")
        self.check_beam_search(request)
        prompt = request.prompt
        if isinstance(prompt, list) and (not prompt or any(isinstance(p, list) and not p for p in prompt)):
            raise InvalidRequestError("prompt must not be empty", "prompt")
        return request

    def sampling_params(self, request: CompletionRequest) -> SamplingParams:
        # Echoed prompts with logprobs need the prompt's logprobs too.
        prompt_lps = request.logprobs if request.echo and request.logprobs is not None else None
        if request.prompt_logprobs is not None:
            prompt_lps = max(prompt_lps or 0, request.prompt_logprobs)
        overrides, logprobs = {}, request.logprobs
        if self._best_of(request) > request.n:  # sample best_of, keep the n of highest cumulative logprob
            overrides, logprobs = {"n": self._best_of(request)}, request.logprobs or 0
        return build_sampling_params(request, max_tokens=request.max_tokens, logprobs=logprobs,
                                     prompt_logprobs=prompt_lps, defaults=self.default_sampling_params,
                                     **overrides)

    @staticmethod
    def _best_of(request: CompletionRequest) -> int:
        return request.best_of or request.n

    def pre_process(self, request: CompletionRequest) -> list[EnginePrompt]:
        """Runs on the tokenizer thread: text prompts are tokenized here (the engine takes the ids as
        they are), so the prompt + max_tokens room is checked before anything is queued."""
        prompt = request.prompt
        if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        prompts = [self._engine_prompt(p, request.truncate_prompt_tokens, request.add_special_tokens) for p in prompt]
        self.check_room(prompts, request.max_tokens, "max_tokens")
        return prompts

    def _engine_prompt(self, p: str | list[int], truncate: int | None, add_special_tokens: bool) -> EnginePrompt:
        if not isinstance(p, str):
            return EnginePrompt(prompt_token_ids=self.truncate(p, truncate))
        if self.tokenizer is None:
            return EnginePrompt(prompt=p)
        ids = self.encode(p, add_special_tokens=add_special_tokens, param="prompt", truncate=truncate)
        # A truncated prompt is no longer the text: the engine (and echo) take the kept ids.
        return EnginePrompt(prompt=p if truncate is None else None, prompt_token_ids=ids)

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(output.prompt_token_ids or [])

    def _choice(self, request: CompletionRequest, prompt_index: int, output: RequestOutput, c: Any,
                first: bool, lp_builder: CompletionLogprobs | None) -> dict[str, Any]:
        text = c.text
        token_ids, lps = list(c.token_ids), list(c.logprobs or [])
        if first and request.echo:
            text = self._prompt_text(output) + text
            prompt_ids = list(output.prompt_token_ids or [])
            token_ids = prompt_ids + token_ids
            lps = list(output.prompt_logprobs or [None] * len(prompt_ids)) + lps
        choice = {
            "index": prompt_index * request.n + c.index,
            "text": text,
            "logprobs": lp_builder.build(token_ids, lps) if lp_builder is not None else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if request.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(output, self.tokenizer) if first else None
        if request.return_token_ids:  # vLLM's: the prompt's ids on a choice's first chunk, then each delta's
            choice["prompt_token_ids"] = list(output.prompt_token_ids or []) if first else None
            choice["token_ids"] = list(c.token_ids)
        return choice

    def _builder(self, request: CompletionRequest) -> CompletionLogprobs | None:
        if request.logprobs is None:
            return None
        return CompletionLogprobs(request.logprobs, self.tokenizer, as_ids=request.return_tokens_as_token_ids)

    def _keep_best(self, request: CompletionRequest, output: RequestOutput) -> list[Any]:
        """Of best_of samples, the n of highest cumulative logprob, renumbered 0..n-1 (OpenAI's best_of)."""
        if self._best_of(request) == request.n:
            return list(output.outputs)
        def score(c: Any) -> float:
            return sum(entries[t].logprob for t, entries in zip(c.token_ids, c.logprobs or []) if t in entries)
        best = sorted(output.outputs, key=score, reverse=True)[: request.n]
        kept = []
        for i, c in enumerate(sorted(best, key=lambda c: c.index)):
            c.index = i
            if request.logprobs is None:
                c.logprobs = None
            kept.append(c)
        return kept

    def post_process(self, request: CompletionRequest, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
        choices = []
        for pi, output in enumerate(outputs):
            for c in self._keep_best(request, output):
                choices.append(self._choice(request, pi, output, c, True, self._builder(request)))
        return {
            "id": request.request_id, "object": "text_completion", "created": request.created,
            "model": self.model_name(request), "choices": choices, "usage": usage(outputs),
        }

    def create_stream(self, request: CompletionRequest) -> CompletionStream:
        return CompletionStream(self, request)


class CompletionStream(StreamBase):
    object_name = "text_completion"

    def __init__(self, processor: CompletionProcessor, request: CompletionRequest) -> None:
        super().__init__(processor, request)
        self.completion = processor
        self.builders: dict[int, CompletionLogprobs] = {}

    def on_output(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        """One chunk per choice with something new (text, tokens or its finish reason)."""
        request: CompletionRequest = self.request  # type: ignore[assignment]
        self.count(prompt_index, output)
        choices = []
        for c in output.outputs:
            index = prompt_index * request.n + c.index
            first = index not in self.started
            if not (first or c.text or c.token_ids or c.finish_reason is not None):
                continue
            self.started.add(index)
            builder = None
            if request.logprobs is not None:
                builder = self.builders.setdefault(index, self.completion._builder(request))
            choices.append(self.completion._choice(request, prompt_index, output, c, first, builder))
        return [self.envelope([choice]) for choice in choices]
