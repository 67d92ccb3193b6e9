"""The "chat" IO processor: /v1/chat/completions bodies rendered with the model's chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from keel.engine.outputs import RequestOutput
from keel.engine.sampling_params import SamplingParams
from keel.io import EnginePrompt
from keel_io_processors.base import OpenAIProcessorBase, StreamBase, usage
from keel_io_processors.logprobs import chat_logprobs
from keel_io_processors.protocol import ChatCompletionRequest, InvalidRequestError, validate
from keel_io_processors.template import RESERVED_VARIABLES, render_chat_template


class ChatTemplateError(InvalidRequestError):
    """The model has no chat template (or it failed to render): HTTP 400."""


def _content_text(content: str | list[dict[str, Any]] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise InvalidRequestError(
                f"{where}.content.{i}: content part type {kind!r} is not supported; only 'text' parts are",
                f"{where}.content",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{where}.content.{i}.text must be a string", f"{where}.content")
        texts.append(text)
    # List-of-parts content is joined as vLLM does for templates that expect a string.
    return "\n".join(texts)


class ChatProcessor(OpenAIProcessorBase):
    """Renders `messages` with the tokenizer's chat template (or the request's `chat_template`),
    tokenizing without adding special tokens (the template places them), as HF and vLLM do.

    `pre_process` runs the template and the tokenizer: callers run it off the event loop.
    """

    request_model = ChatCompletionRequest

    def parse_request(self, payload: Any) -> ChatCompletionRequest:
        request = validate(ChatCompletionRequest, payload, "chatcmpl")
        if request.chat_template is not None and not self.limits.trust_request_chat_template:
            raise InvalidRequestError(
                "chat_template in the request is refused: this server renders only the model's own chat "
                "template (start it with --trust-request-chat-template to allow request templates)",
                "chat_template")
        if request.top_logprobs is not None and request.top_logprobs > 0 and not request.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        for i, m in enumerate(request.messages):
            _content_text(m.content, f"messages.{i}")  # reject unsupported parts before any work
        return request

    def sampling_params(self, request: ChatCompletionRequest) -> SamplingParams:
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.max_completion_tokens or request.max_tokens
        return build(request, max_tokens, logprobs)

    def render(self, request: ChatCompletionRequest) -> str:
        """The conversation as prompt text; ChatTemplateError when there is no template to use."""
        tok = self.tokenizer
        if tok is None:
            raise ChatTemplateError("chat completions need a tokenizer; this server runs without one")
        if request.chat_template is None and getattr(tok, "chat_template", None) is None:
            raise ChatTemplateError(
                "this model has no chat template, so chat completions cannot be rendered; use "
                "/v1/completions with a prompt, or pass `chat_template` in the request", "messages")
        messages: list[Mapping[str, Any]] = []
        for i, m in enumerate(request.messages):
            msg: dict[str, Any] = {"role": m.role, "content": _content_text(m.content, f"messages.{i}")}
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        variables = {**tok.special_tokens_map, **(request.chat_template_kwargs or {})}
        reserved = sorted(set(request.chat_template_kwargs or ()) & RESERVED_VARIABLES)
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs cannot set {reserved}: the server sets them",
                                      "chat_template_kwargs")
        try:
            source = tok.get_chat_template(request.chat_template)
            text = render_chat_template(
                source, messages, variables=variables, limits=self.limits,
                add_generation_prompt=request.add_generation_prompt and not request.continue_final_message,
                continue_final_message=request.continue_final_message)
        except InvalidRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 -- a template error is the request's fault, not a 500
            raise ChatTemplateError(f"the chat template failed to render: {exc}", "messages") from None
        return text

    def pre_process(self, request: ChatCompletionRequest) -> list[EnginePrompt]:
        text = self.render(request)
        ids = self.encode(text, add_special_tokens=False, param="messages")
        prompts = [EnginePrompt(prompt=text, prompt_token_ids=ids)]
        self.check_room(prompts, request.max_completion_tokens or request.max_tokens,
                        "max_completion_tokens" if request.max_completion_tokens else "max_tokens")
        return prompts

    def _logprobs(self, request: ChatCompletionRequest, c: Any) -> dict[str, Any] | None:
        if not request.logprobs or c.logprobs is None:
            return None
        return chat_logprobs(c.token_ids, c.logprobs, request.top_logprobs or 0, self.tokenizer)

    def post_process(self, request: ChatCompletionRequest, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(request, c),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for o in outputs for c in o.outputs
        ]
        return {
            "id": request.request_id, "object": "chat.completion", "created": request.created,
            "model": self.model_name(request), "choices": choices, "usage": usage(outputs),
        }

    def create_stream(self, request: ChatCompletionRequest) -> ChatStream:
        return ChatStream(self, request)


def build(request: ChatCompletionRequest, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    from keel_io_processors.sampling import build_sampling_params

    return build_sampling_params(request, max_tokens=max_tokens, logprobs=logprobs)


class ChatStream(StreamBase):
    """First chunk of a choice: `delta: {role: assistant, content: ""}`; then content deltas; the last
    content chunk of a choice carries its finish_reason."""

    object_name = "chat.completion.chunk"

    def __init__(self, processor: ChatProcessor, request: ChatCompletionRequest) -> None:
        super().__init__(processor, request)
        self.chat = processor

    def on_output(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        request: ChatCompletionRequest = self.request  # type: ignore[assignment]
        self.count(prompt_index, output)
        chunks = []
        for c in output.outputs:
            if c.index not in self.started:
                self.started.add(c.index)
                chunks.append(self.envelope([{
                    "index": c.index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None,
                }]))
            if not (c.text or c.token_ids or c.finish_reason is not None):
                continue
            chunks.append(self.envelope([{
                "index": c.index, "delta": {"content": c.text},
                "logprobs": self.chat._logprobs(request, c),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            }]))
        return chunks
