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
from keel.io import EnginePrompt, RequestLimits, inline_refs
from keel_io_processors.protocol import InvalidRequestError, SamplingFields

# Tokens a prefix may hold beyond max_model_len before the prompt is refused: the cut may split a
# word and so tokenize a little differently from the whole text.
_PREFIX_MARGIN = 16


class OpenAIProcessorBase:
    """Created by the API server once, with the engine's tokenizer; stateless across requests."""

    def __init__(self, *, tokenizer: Any = None, served_model_name: str = "", max_model_len: int | None = None,
                 limits: RequestLimits | None = None, **_: Any) -> None:
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.limits = limits if limits is not None else RequestLimits()
        self._token_chars: int | None = None

    request_model: type[SamplingFields] = SamplingFields

    def request_schema(self) -> dict[str, Any]:
        """The JSON schema of the request body (the API server publishes it in /openapi.json)."""
        return inline_refs(self.request_model.model_json_schema())

    def is_stream(self, request: SamplingFields) -> bool:
        return bool(request.stream)

    def model_name(self, request: SamplingFields) -> str:
        return self.served_model_name or request.model or ""

    def encode(self, text: str, *, add_special_tokens: bool, param: str) -> tuple[int, ...]:
        """`text` as token ids, refusing a text far past max_model_len after tokenizing only a prefix.

        No token covers more than `max_token_chars` characters, so the first
        `(max_model_len + margin) * max_token_chars` characters of any prompt that fits cannot hold
        more than max_model_len + margin tokens: if they do, the prompt cannot fit, and a 50 MB prompt
        costs the tokenizer no more than that prefix. (A normalizer that deletes characters only makes
        the prefix shorter in tokens, and then the whole text is tokenized as before.)"""
        tok = self.tokenizer
        if self.max_model_len is not None:
            budget = self.max_model_len + _PREFIX_MARGIN
            limit = budget * self._max_token_chars()
            if len(text) > limit:
                head = tok.encode(text[:limit], add_special_tokens=add_special_tokens)
                if len(head) >= budget:
                    raise InvalidRequestError(
                        f"This model's maximum context length (max_model_len) is {self.max_model_len} tokens, "
                        f"but the prompt is longer: its first {limit} of {len(text)} characters already hold "
                        f"{len(head)} tokens. Please reduce the length of the prompt.", param)
        return tuple(tok.encode(text, add_special_tokens=add_special_tokens))

    def _max_token_chars(self) -> int:
        """The most characters one token can stand for (the longest vocabulary entry; byte-level BPE
        entries hold one character per byte, and a byte is at most one character of text)."""
        if self._token_chars is None:
            self._token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=1) or 1
        return self._token_chars

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
