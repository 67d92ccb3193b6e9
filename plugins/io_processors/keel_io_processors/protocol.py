"""OpenAI request bodies (pydantic) plus vLLM's extra sampling fields, and the request error type.

Validation is strict on types (a string where a number belongs is a 400, never coerced) and open on
fields: unknown fields are accepted and ignored, since OpenAI clients send extras -- except fields whose
meaning we know and do not implement (`unsupported.py`), which are a 400 naming them. Ranges OpenAI defines
(max_tokens >= 1, logprobs <= 20, ...) are checked here; the rest by `SamplingParams`.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from keel.engine.limits import INT64_MAX, INT64_MIN

MAX_LOGPROBS = 20


class InvalidRequestError(ValueError):
    """A request the API must answer with HTTP 400; `param` names the offending field, if one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


# Union members pydantic adds to an error location ("stop.str", "prompt.list[int]"): not field names.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|dict|list)$|\[")


def field_path(loc: tuple[Any, ...]) -> str:
    """`('messages', 0, 'content', 'str')` -> `'messages.0.content'`."""
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and _UNION_TAG.search(p)))


def from_validation_error(exc: ValidationError) -> InvalidRequestError:
    """The first pydantic error as an InvalidRequestError naming its field path."""
    err = exc.errors()[0]
    loc = field_path(tuple(err.get("loc", ())))
    message = f"{loc}: {err['msg']}" if loc else str(err["msg"])
    if err.get("type") == "missing":
        message = f"'{loc}' is a required property"
    return InvalidRequestError(message, loc or None)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# Every integer a request carries must fit the engine's int64 rows (keel.engine.limits): bounded here
# so that the 400 names the request's own field.
NonNegInt = Annotated[int, Field(ge=0, le=INT64_MAX)]
PosInt = Annotated[int, Field(ge=1, le=INT64_MAX)]


class SamplingFields(_Strict):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    stop_token_ids: list[NonNegInt] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: NonNegInt | None = None
    # Keep the prompt's last N tokens (-1: max_model_len), as vLLM does.
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    return_token_ids: bool = False  # the prompt's and each choice's token ids in the response
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:<id>"
    cache_salt: str | None = Field(None, min_length=1)  # mixed into the prefix-cache hashes (tenants)
    priority: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] = 0  # under --scheduling-policy priority
    # Arguments for the server's logits processors (SamplingParams.extra_args); each processor checks its own.
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    # vLLM's beam search: n beams; the score is cumulative logprob / length ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-100.0, le=100.0)

    _request_id: str = PrivateAttr(default="")
    _created: int = PrivateAttr(default=0)

    def stamp(self, prefix: str) -> None:
        """Called once by `parse_request`: the response id and creation time."""
        self._request_id = f"{prefix}-{uuid.uuid4().hex}"
        self._created = int(time.time())

    @property
    def request_id(self) -> str:
        return self._request_id

    @property
    def created(self) -> int:
        return self._created

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk (vLLM's `stream_options.continuous_usage_stats`)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)  # type: ignore[union-attr]


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: PosInt | None = 16
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: PosInt | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (and such) around the prompt


class ChatMessage(_Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: PosInt | None = None
    max_completion_tokens: PosInt | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM extras for templating
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # the reply starts with the last message when it has the assistant's role
    add_special_tokens: bool = False  # vLLM's: on top of the ones the chat template places


def parse_model(model: type[BaseModel], payload: Any) -> Any:
    """A decoded JSON body as `model`; InvalidRequestError (HTTP 400) naming the field on any problem."""
    if not isinstance(payload, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, got {type(payload).__name__}")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def validate(model: type[SamplingFields], payload: Any, prefix: str) -> Any:
    """Parse a decoded JSON body into `model` and check it; InvalidRequestError (HTTP 400) on any problem."""
    request = parse_model(model, payload)
    request.stamp(prefix)
    from keel_io_processors.unsupported import check_unsupported

    check_unsupported(request, chat=isinstance(request, ChatCompletionRequest))
    if request.stream_options is not None and not request.stream:
        raise InvalidRequestError("stream_options can only be set when stream is true", "stream_options")
    return request
