"""What the completion and chat processors share: construction, prompt hand-off, usage, envelopes.

Beyond `keel.io.IOProcessor` (parse_request, pre_process, post_process) the OpenAI processors offer
what the endpoints plugin's OpenAI routes need for streaming and sampling:

    sampling_params(request) -> SamplingParams     # HTTP 400 (InvalidRequestError) on bad values
    is_stream(request) -> bool
    create_stream(request) -> stream with on_output(prompt_index, RequestOutput) -> list[chunk dict]
                                          and finish() -> list[chunk dict]   (the usage chunk)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keel.engine.outputs import RequestOutput
from keel.engine.prompt_bound import PromptBound, PromptTooLongError
from keel.io import EnginePrompt, RequestLimits, inline_refs
from keel_io_processors.protocol import InvalidRequestError, SamplingFields


class OpenAIProcessorBase:
    """Created by the API server once, with the engine's tokenizer; stateless across requests."""

    def __init__(self, *, tokenizer: Any = None, served_model_name: str = "", max_model_len: int | None = None,
                 limits: RequestLimits | None = None, **_: Any) -> None:
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.limits = limits if limits is not None else RequestLimits()
        self._bound = PromptBound(tokenizer, max_model_len)

    request_model: type[SamplingFields] = SamplingFields

    def request_schema(self) -> dict[str, Any]:
        """The JSON schema of the request body (the API server publishes it in /openapi.json)."""
        return inline_refs(self.request_model.model_json_schema())

    def is_stream(self, request: SamplingFields) -> bool:
        return bool(request.stream)

    def model_name(self, request: SamplingFields) -> str:
        return self.served_model_name or request.model or ""

    def encode(self, text: str, *, add_special_tokens: bool, param: str) -> tuple[int, ...]:
        """`text` as token ids; a text far past max_model_len is refused (HTTP 400 naming `param`) after
        tokenizing only a prefix (`keel.engine.prompt_bound`)."""
        try:
            return tuple(self._bound.encode(text, add_special_tokens=add_special_tokens, param=param))
        except PromptTooLongError as exc:
            raise InvalidRequestError(exc.message, exc.param) from None

    def check_room(self, prompts: Sequence[EnginePrompt], max_tokens: int | None, param: str) -> None:
        """OpenAI's (and vLLM's) rule: an explicit max_tokens that does not fit beside the prompt is a 400,
        not a silently shorter completion. Prompts too long by themselves are refused by the engine."""
        if max_tokens is None or self.max_model_len is None:
            return
        for p in prompts:
            n = len(p.prompt_token_ids or ())
            if n and n < self.max_model_len < n + max_tokens:
                raise InvalidRequestError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                    f"requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion). "
                    "Please reduce the length of the prompt or completion.", param)


def usage(outputs: Sequence[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids or ()) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class StreamBase:
    """Per-request streaming state: which choices have started and the running token counts."""

    object_name = ""

    def __init__(self, processor: OpenAIProcessorBase, request: SamplingFields) -> None:
        self.processor = processor
        self.request = request
        self.model = processor.model_name(request)
        self.started: set[int] = set()
        self.prompt_seen: set[int] = set()
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.request.request_id, "object": self.object_name, "created": self.request.created,
            "model": self.model, "choices": choices,
        }
        if self.request.include_usage:
            chunk["usage"] = None
        return chunk

    def count(self, prompt_index: int, output: RequestOutput) -> None:
        if prompt_index not in self.prompt_seen:
            self.prompt_seen.add(prompt_index)
            self.prompt_tokens += len(output.prompt_token_ids or ())
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def finish(self) -> list[dict[str, Any]]:
        """Chunks after the last output: the usage chunk, if `stream_options.include_usage`."""
        if not self.request.include_usage:
            return []
        chunk = self.envelope([])
        chunk["usage"] = {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        return [chunk]
