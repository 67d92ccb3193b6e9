"""The "responses" IO processor: OpenAI's Responses API (POST /v1/responses), text in and out.

A request is translated into a chat request (`instructions` -> a system message, `input` -> messages,
`max_output_tokens`, `text.format` -> `response_format`, `top_logprobs`) and rendered, sampled and
checked by the chat processor; outputs become a `response` object, or when streaming the Responses
event sequence (response.created ... response.output_text.delta ... response.completed). Fields asking
for what keel does not do (stored responses, previous_response_id, tools, reasoning settings,
background runs) are a 400 naming them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from keel.engine.outputs import RequestOutput
from keel.engine.sampling_params import SamplingParams
from keel.io import EnginePrompt, inline_refs
from keel_io_processors.chat import ChatProcessor
from keel_io_processors.protocol import (
    MAX_LOGPROBS,
    ChatCompletionRequest,
    InvalidRequestError,
    parse_model,
)

# field -> the value(s) that ask for nothing; any other value is a 400 naming the field.
_ONLY = {"store": (False,), "background": (False,), "previous_response_id": (), "conversation": (),
         "reasoning": (), "prompt": (), "include": ([],), "tools": ([],), "tool_choice": ("auto", "none"),
         "truncation": ("disabled",), "service_tier": ("auto", "default"), "max_tool_calls": ()}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    stream: bool = False
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    parallel_tool_calls: bool = True


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or a list of parts", f"{where}.content")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(f"{where}.content.{i}: part type {kind!r} is not supported; only text parts",
                                      f"{where}.content")
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}.content.{i}.text must be a string", f"{where}.content")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_body(req: ResponsesRequest) -> dict[str, Any]:
    """The chat request that serves `req` (messages, limits, sampling, format)."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        if item.get("type", "message") != "message" or item.get("role") not in ("user", "system", "developer",
                                                                                  "assistant"):
            raise InvalidRequestError(f"input.{i}: only message items with a user, system, developer or "
                                      f"assistant role are supported", f"input.{i}")
        role = "system" if item["role"] == "developer" else item["role"]
        messages.append({"role": role, "content": _text_of(item.get("content"), f"input.{i}")})
    body: dict[str, Any] = {"messages": messages, "stream": req.stream}
    for name, value in (("model", req.model), ("max_completion_tokens", req.max_output_tokens),
                        ("temperature", req.temperature), ("top_p", req.top_p), ("user", req.user)):
        if value is not None:
            body[name] = value
    if req.top_logprobs is not None:
        body.update(logprobs=True, top_logprobs=req.top_logprobs)
    fmt = (req.text or {}).get("format")
    if fmt is not None and fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif fmt is not None and fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.get("type") != "text":
        raise InvalidRequestError(f"text.format type {fmt.get('type')!r} is not supported", "text.format")
    return body


@dataclass
class ResponsesCall:
    """A parsed /v1/responses request: the chat request serving it and the original (its fields echo
    back in the response object). Other attributes are the chat request's (model, cache_salt, ...)."""

    chat: ChatCompletionRequest
    original: ResponsesRequest
    request_id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.chat, name)


class ResponsesProcessor:
    """Created by the API server once (the same keywords as the chat processor, which it wraps)."""

    def __init__(self, **kwargs: Any) -> None:
        self.chat = ChatProcessor(**kwargs)

    def request_schema(self) -> dict[str, Any]:
        return inline_refs(ResponsesRequest.model_json_schema())

    def parse_request(self, payload: Any) -> ResponsesCall:
        req: ResponsesRequest = parse_model(ResponsesRequest, payload)
        extra = req.model_extra or {}
        for name, allowed in _ONLY.items():
            if extra.get(name) is not None and extra[name] not in allowed:
                raise InvalidRequestError(f"{name} is not supported by this server's /v1/responses "
                                          f"(allowed: {list(allowed) or 'unset'})", name)
        if req.stream and self.chat.reasoning_parser is not None:
            raise InvalidRequestError("streaming /v1/responses with a reasoning parser is not supported yet",
                                      "stream")
        chat = self.chat.parse_request({**chat_body(req), **{k: v for k, v in extra.items() if k not in _ONLY}})
        return ResponsesCall(chat, req)

    def is_stream(self, call: ResponsesCall) -> bool:
        return bool(call.chat.stream)

    def sampling_params(self, call: ResponsesCall) -> SamplingParams:
        return self.chat.sampling_params(call.chat)

    def pre_process(self, call: ResponsesCall) -> list[EnginePrompt]:
        return self.chat.pre_process(call.chat)

    def response(self, call: ResponsesCall, status: str, output: list[dict[str, Any]],
                 tokens: tuple[int, int, int] | None = None, incomplete: str | None = None) -> dict[str, Any]:
        """The response object; `tokens` = (prompt, cached, output) once known."""
        req = call.original
        body: dict[str, Any] = {
            "id": call.request_id, "object": "response", "created_at": call.created, "status": status,
            "model": self.chat.model_name(call.chat), "output": output, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "top_logprobs": req.top_logprobs,
            "parallel_tool_calls": req.parallel_tool_calls, "tool_choice": "auto", "tools": [],
            "text": req.text or {"format": {"type": "text"}}, "previous_response_id": None, "store": False,
            "metadata": req.metadata or {}, "user": req.user, "usage": None,
        }
        if tokens is not None:
            prompt, cached, out = tokens
            body["usage"] = {"input_tokens": prompt, "output_tokens": out, "total_tokens": prompt + out,
                             "input_tokens_details": {"cached_tokens": cached},
                             "output_tokens_details": {"reasoning_tokens": 0}}
        return body

    def _logprobs(self, call: ResponsesCall, c: Any) -> list[dict[str, Any]]:
        lps = self.chat._logprobs(call.chat, c)
        return lps["content"] if lps is not None else []

    def post_process(self, call: ResponsesCall, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
        o = outputs[0]
        c = o.outputs[0]
        msg, _ = self.chat.message(c.text)
        items: list[dict[str, Any]] = []
        if msg.get("reasoning_content"):
            items.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                          "content": [{"type": "reasoning_text", "text": msg["reasoning_content"]}]})
        items.append(message_item(f"msg_{uuid.uuid4().hex}", "completed", msg["content"] or "",
                                  self._logprobs(call, c)))
        incomplete = "max_output_tokens" if c.finish_reason == "length" else None
        tokens = (len(o.prompt_token_ids or ()), o.num_cached_tokens or 0, len(c.token_ids))
        return self.response(call, "incomplete" if incomplete else "completed", items, tokens, incomplete)

    def create_stream(self, call: ResponsesCall) -> ResponsesStream:
        return ResponsesStream(self, call)


def message_item(item_id: str, status: str, text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


class ResponsesStream:
    """The Responses streaming events of one request, each with its `sequence_number`."""

    def __init__(self, processor: ResponsesProcessor, call: ResponsesCall) -> None:
        self.processor = processor
        self.call = call
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.text = ""
        self.logprobs: list[dict[str, Any]] = []
        self.sequence = 0
        self.tokens = [0, 0, 0]  # prompt, cached, output
        self.finish_reason: str | None = None
        self.started = False

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def on_output(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        events = []
        if not self.started:
            self.started = True
            shell = self.processor.response(self.call, "in_progress", [])
            self.tokens[:2] = [len(output.prompt_token_ids or ()), output.num_cached_tokens or 0]
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += [self.event("response.created", response=shell),
                       self.event("response.in_progress", response=shell),
                       self.event("response.output_item.added", output_index=0,
                                  item=message_item(self.item_id, "in_progress", "", []) | {"content": []}),
                       self.event("response.content_part.added", item_id=self.item_id, output_index=0,
                                  content_index=0, part=part)]
        c = output.outputs[0]
        self.tokens[2] += len(c.token_ids)
        self.finish_reason = c.finish_reason or self.finish_reason
        lps = self.processor._logprobs(self.call, c)
        self.logprobs += lps
        if c.text:
            self.text += c.text
            events.append(self.event("response.output_text.delta", item_id=self.item_id, output_index=0,
                                     content_index=0, delta=c.text, logprobs=lps))
        return events

    def finish(self) -> list[dict[str, Any]]:
        if not self.started:
            return []
        incomplete = "max_output_tokens" if self.finish_reason == "length" else None
        item = message_item(self.item_id, "completed", self.text, self.logprobs)
        done = self.processor.response(self.call, "incomplete" if incomplete else "completed", [item],
                                       tuple(self.tokens), incomplete)  # type: ignore[arg-type]
        return [self.event("response.output_text.done", item_id=self.item_id, output_index=0, content_index=0,
                           text=self.text, logprobs=self.logprobs),
                self.event("response.content_part.done", item_id=self.item_id, output_index=0, content_index=0,
                           part=item["content"][0]),
                self.event("response.output_item.done", output_index=0, item=item),
                self.event("response.incomplete" if incomplete else "response.completed", response=done)]

