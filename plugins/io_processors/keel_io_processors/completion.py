"""The "completion" IO processor: /v1/completions bodies <-> engine prompts and OpenAI responses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keel.engine.outputs import RequestOutput
from keel.engine.sampling_params import SamplingParams
from keel.io import EnginePrompt
from keel_io_processors.base import OpenAIProcessorBase, StreamBase, usage
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
        if request.best_of is not None and request.best_of != request.n:
            raise InvalidRequestError("best_of is only supported when equal to n", "best_of")
        prompt = request.prompt
        if isinstance(prompt, list) and (not prompt or any(isinstance(p, list) and not p for p in prompt)):
            raise InvalidRequestError("prompt must not be empty", "prompt")
        return request

    def sampling_params(self, request: CompletionRequest) -> SamplingParams:
        # Echoed prompts with logprobs need the prompt's logprobs too.
        prompt_lps = request.logprobs if request.echo and request.logprobs is not None else None
        return build_sampling_params(request, max_tokens=request.max_tokens, logprobs=request.logprobs,
                                     prompt_logprobs=prompt_lps)

    def pre_process(self, request: CompletionRequest) -> list[EnginePrompt]:
        """Runs on the tokenizer thread: text prompts are tokenized here (the engine takes the ids as
        they are), so the prompt + max_tokens room is checked before anything is queued."""
        prompt = request.prompt
        if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        prompts = [self._engine_prompt(p) for p in prompt]
        self.check_room(prompts, request.max_tokens, "max_tokens")
        return prompts

    def _engine_prompt(self, p: str | list[int]) -> EnginePrompt:
        if not isinstance(p, str):
            return EnginePrompt(prompt_token_ids=tuple(p))
        ids = self.encode(p, add_special_tokens=True, param="prompt") if self.tokenizer is not None else None
        return EnginePrompt(prompt=p, prompt_token_ids=ids)

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
        return {
            "index": prompt_index * request.n + c.index,
            "text": text,
            "logprobs": lp_builder.build(token_ids, lps) if lp_builder is not None else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    def post_process(self, request: CompletionRequest, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
        choices = []
        for pi, output in enumerate(outputs):
            for c in output.outputs:
                builder = (CompletionLogprobs(request.logprobs, self.tokenizer)
                           if request.logprobs is not None else None)
                choices.append(self._choice(request, pi, output, c, True, builder))
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
                builder = self.builders.setdefault(
                    index, CompletionLogprobs(request.logprobs, self.completion.tokenizer))
            choices.append(self.completion._choice(request, prompt_index, output, c, first, builder))
        return [self.envelope([choice]) for choice in choices]
