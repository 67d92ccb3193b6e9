"""What the completion and chat processors share: construction, prompt hand-off, usage, envelopes.

Beyond `keel.io.IOProcessor` (parse_request, pre_process, post_process) the OpenAI processors offer
what the endpoints plugin's OpenAI routes need for streaming and sampling:

    sampling_params(request) -> SamplingParams     # HTTP 400 (InvalidRequestError) on bad values
    is_stream(request) -> bool
    create_stream(request) -> stream with on_output(prompt_index, RequestOutput) -> list[chunk dict]
                                          and finish() -> list[chunk dict]   (the usage chunk)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from keel.engine.outputs import RequestOutput
from keel.engine.prompt_bound import PromptBound, PromptTooLongError
from keel.io import EnginePrompt, RequestLimits, inline_refs
from keel_io_processors.protocol import InvalidRequestError, SamplingFields


class OpenAIProcessorBase:
    """Created by the API server once, with the engine's tokenizer; stateless across requests."""

    def __init__(self, *, tokenizer: Any = None, served_model_name: str = "", max_model_len: int | None = None,
                 limits: RequestLimits | None = None, default_sampling_params: Mapping[str, Any] | None = None,
                 **_: Any) -> None:
        self.tokenizer = tokenizer
        # The model's generation-config defaults (SamplingParams names) for fields a request leaves unset.
        self.default_sampling_params = dict(default_sampling_params or {})
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

    def encode(self, text: str, *, add_special_tokens: bool, param: str,
               truncate: int | None = None) -> tuple[int, ...]:
        """`text` as token ids; a text far past max_model_len is refused (HTTP 400 naming `param`) after
        tokenizing only a prefix (`keel.engine.prompt_bound`) -- unless the request truncates its prompt
        (`truncate_prompt_tokens`): then its last tokens are kept (the body's size bounds the text)."""
        if truncate is not None:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            return self.truncate(ids, truncate)
        try:
            return tuple(self._bound.encode(text, add_special_tokens=add_special_tokens, param=param))
        except PromptTooLongError as exc:
            raise InvalidRequestError(exc.message, exc.param) from None

    def truncate(self, ids: Sequence[int], n: int | None) -> tuple[int, ...]:
        """The last `n` of `ids` (vLLM's `truncate_prompt_tokens`; -1: max_model_len); all if None."""
        if n is None:
            return tuple(ids)
        limit = self.max_model_len if n == -1 else n
        if self.max_model_len is not None and limit is not None and limit > self.max_model_len:
            raise InvalidRequestError(f"truncate_prompt_tokens ({n}) is greater than max_model_len "
                                      f"({self.max_model_len}); send a smaller value", "truncate_prompt_tokens")
        return tuple(ids[-limit:]) if limit else ()

    @staticmethod
    def check_beam_search(request: SamplingFields) -> None:
        """Beam search answers once, at the end, with n beams: no streaming, no best_of."""
        if request.use_beam_search and request.stream:
            raise InvalidRequestError("use_beam_search cannot be streamed: the best beams are only known at the "
                                      "end", "use_beam_search")
        if request.use_beam_search and getattr(request, "best_of", None) not in (None, request.n):
            raise InvalidRequestError("use_beam_search takes n beams; best_of does not apply", "best_of")

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


def usage(outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids or ()) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return usage_dict(prompt, completion, sum(o.num_cached_tokens or 0 for o in outputs))


def usage_dict(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` are prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def prompt_logprobs_json(output: RequestOutput, tokenizer: Any) -> list[Any] | None:
    """vLLM's `prompt_logprobs` in a response: per prompt position None (the first) or
    {token id: {logprob, rank, decoded_token}}."""
    from keel_io_processors.logprobs import clamp, token_text

    if output.prompt_logprobs is None:
        return None
    return [None if entries is None else
            {str(tid): {"logprob": clamp(lp.logprob), "rank": lp.rank, "decoded_token": token_text(tid, lp, tokenizer)}
             for tid, lp in entries.items()}
            for entries in output.prompt_logprobs]


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
        self.cached_tokens = 0

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.request.request_id, "object": self.object_name, "created": self.request.created,
            "model": self.model, "choices": choices,
        }
        if self.request.include_usage:
            chunk["usage"] = self.usage() if self.request.continuous_usage else None
        return chunk

    def usage(self) -> dict[str, Any]:
        return usage_dict(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def count(self, prompt_index: int, output: RequestOutput) -> None:
        if prompt_index not in self.prompt_seen:
            self.prompt_seen.add(prompt_index)
            self.prompt_tokens += len(output.prompt_token_ids or ())
            self.cached_tokens += output.num_cached_tokens or 0
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def finish(self) -> list[dict[str, Any]]:
        """Chunks after the last output: the usage chunk, if `stream_options.include_usage`."""
        if not self.request.include_usage:
            return []
        chunk = self.envelope([])
        chunk["usage"] = self.usage()
        return [chunk]
