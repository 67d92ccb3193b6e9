"""The "chat" IO processor: /v1/chat/completions bodies rendered with the model's chat template."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from keel.engine.outputs import RequestOutput
from keel.engine.sampling_params import SamplingParams
from keel.io import EnginePrompt
from keel.reasoning import ReasoningParser, ReasoningStream
from keel.tool_parser import ToolCallStream, ToolParser, new_call_id
from keel_io_processors.base import OpenAIProcessorBase, StreamBase, prompt_logprobs_json, usage
from keel_io_processors.logprobs import chat_logprobs
from keel_io_processors.protocol import ChatCompletionRequest, InvalidRequestError, validate
from keel_io_processors.template import RESERVED_VARIABLES, render_chat_template
from keel_io_processors.tools import ToolRequest, parser_for, tool_request


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

    `pre_process` runs the template and the tokenizer: callers run it off the event loop. With a
    `reasoning_parser` option (a registry key) answers carry `reasoning_content` split from `content`;
    a key no plugin provides stops the server at startup.
    """

    request_model = ChatCompletionRequest

    def __init__(self, *, plugin_set: Any = None, plugin_options: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        options = plugin_options or {}
        self.reasoning_parser: ReasoningParser | None = self._parser(plugin_set, "reasoning_parser", options)
        self.tool_parser: ToolParser | None = self._parser(plugin_set, "tool_parser", options, "tool_call_parser")

    def _parser(self, plugin_set: Any, kind: str, options: Mapping[str, Any], option: str | None = None) -> Any:
        name = options.get(option or kind)
        if not name:
            return None
        registry = plugin_set.registry(kind) if plugin_set is not None else None
        if registry is None or name not in registry:
            known = registry.keys() if registry is not None else []
            raise ValueError(f"{option or kind} {name!r} is not provided by any loaded plugin; known: {known}")
        return registry.get(name)(self.tokenizer)

    def message(self, text: str, tools: ToolRequest | None = None) -> tuple[dict[str, Any], bool]:
        """A finished choice's message (reasoning split off, tool calls parsed) and whether it calls tools."""
        msg: dict[str, Any] = {"role": "assistant"}
        if self.reasoning_parser is not None:
            reasoning, text = self.reasoning_parser.split(text)
            msg["reasoning_content"] = reasoning
        parser = parser_for(tools, self.tool_parser) if tools is not None else None
        if parser is None:
            msg["content"] = text
            return msg, False
        content, calls = parser.parse(text or "")
        if tools.choice != "auto" and (not calls or any(c.name is None or not c.complete for c in calls)):
            content, calls = text, []  # cut short (length): what there is stays visible as content
        if not tools.parallel:
            calls = calls[:1]
        msg["content"] = content
        if calls:
            msg["tool_calls"] = [{"id": new_call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return msg, bool(calls)

    def parse_request(self, payload: Any) -> ChatCompletionRequest:
        request = validate(ChatCompletionRequest, payload, "chatcmpl")
        tool_request(request, self.tool_parser)  # a bad tools / tool_choice is a 400 before any work
        if request.chat_template is not None and not self.limits.trust_request_chat_template:
            raise InvalidRequestError(
                "chat_template in the request is refused: this server renders only the model's own chat "
                "template (start it with --trust-request-chat-template to allow request templates)",
                "chat_template")
        if request.top_logprobs is not None and request.top_logprobs > 0 and not request.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        for i, m in enumerate(request.messages):
            _content_text(m.content, f"messages.{i}")  # reject unsupported parts before any work
        self.check_beam_search(request)
        return request

    def sampling_params(self, request: ChatCompletionRequest) -> SamplingParams:
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.max_completion_tokens or request.max_tokens
        tools = tool_request(request, self.tool_parser)
        overrides: dict[str, Any] = {}
        if tools is not None and tools.constraint() is not None:
            overrides["structured_outputs"] = tools.constraint()
        if tools is not None and tools.choice == "auto" and self.tool_parser.keeps_special_tokens:
            overrides["skip_special_tokens"] = False  # the parser's markers are special tokens
        return build(request, max_tokens, logprobs, defaults=self.default_sampling_params, **overrides)

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
            msg.update(_tool_fields(m.model_extra or {}))
            messages.append(msg)
        variables = {**tok.special_tokens_map, **(request.chat_template_kwargs or {})}
        reserved = sorted(set(request.chat_template_kwargs or ()) & RESERVED_VARIABLES)
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs cannot set {reserved}: the server sets them",
                                      "chat_template_kwargs")
        tools = tool_request(request, self.tool_parser)
        try:
            source = tok.get_chat_template(request.chat_template)
            text = render_chat_template(
                source, messages, variables=variables, limits=self.limits,
                add_generation_prompt=request.add_generation_prompt and not request.continue_final_message,
                continue_final_message=request.continue_final_message,
                tools=list(tools.tools) if tools is not None else None)
        except InvalidRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 -- a template error is the request's fault, not a 500
            raise ChatTemplateError(f"the chat template failed to render: {exc}", "messages") from None
        return text

    def pre_process(self, request: ChatCompletionRequest) -> list[EnginePrompt]:
        text = self.render(request)
        truncate = request.truncate_prompt_tokens
        ids = self.encode(text, add_special_tokens=request.add_special_tokens, param="messages", truncate=truncate)
        # A truncated prompt is no longer the rendered text: the engine takes the kept ids.
        prompts = [EnginePrompt(prompt=text if truncate is None else None, prompt_token_ids=ids)]
        self.check_room(prompts, request.max_completion_tokens or request.max_tokens,
                        "max_completion_tokens" if request.max_completion_tokens else "max_tokens")
        return prompts

    def _logprobs(self, request: ChatCompletionRequest, c: Any) -> dict[str, Any] | None:
        if not request.logprobs or c.logprobs is None:
            return None
        return chat_logprobs(c.token_ids, c.logprobs, request.top_logprobs or 0, self.tokenizer,
                             as_ids=request.return_tokens_as_token_ids)

    def echoed(self, request: ChatCompletionRequest) -> str:
        """vLLM's chat `echo`: the last message's text when it has the reply's role (assistant), else ""."""
        last = request.messages[-1]
        if not request.echo or last.role != "assistant":
            return ""
        return _content_text(last.content, f"messages.{len(request.messages) - 1}")

    def extras(self, request: ChatCompletionRequest, output: RequestOutput, choice: dict[str, Any],
               c: Any, top: dict[str, Any] | None) -> None:
        """vLLM's extra response fields, where the request asked: token ids (`return_token_ids`) on the
        choice, and at the top (`top`, None on later stream chunks) the prompt's ids and logprobs."""
        if request.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        if top is not None and request.return_token_ids:
            top["prompt_token_ids"] = list(output.prompt_token_ids or [])
        if top is not None and request.prompt_logprobs is not None:
            top["prompt_logprobs"] = prompt_logprobs_json(output, self.tokenizer)

    def post_process(self, request: ChatCompletionRequest, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
        tools = tool_request(request, self.tool_parser)
        choices = []
        response: dict[str, Any] = {
            "id": request.request_id, "object": "chat.completion", "created": request.created,
            "model": self.model_name(request), "choices": choices, "usage": usage(outputs),
        }
        echo = self.echoed(request)
        for o in outputs:
            for c in o.outputs:
                message, calls = self.message(echo + c.text, tools)
                choice = {
                    "index": c.index, "message": message, "logprobs": self._logprobs(request, c),
                    "finish_reason": finish_reason(c.finish_reason, calls, tools), "stop_reason": c.stop_reason,
                }
                self.extras(request, o, choice, c, response)
                choices.append(choice)
        return response

    def create_stream(self, request: ChatCompletionRequest) -> ChatStream:
        return ChatStream(self, request)


def build(request: ChatCompletionRequest, max_tokens: int | None, logprobs: int | None,
          **overrides: Any) -> SamplingParams:
    from keel_io_processors.sampling import build_sampling_params

    return build_sampling_params(request, max_tokens=max_tokens, logprobs=logprobs, **overrides)


class ChatStream(StreamBase):
    """First chunk of a choice: `delta: {role: assistant, content: ""}`; then content deltas; the last
    content chunk of a choice carries its finish_reason."""

    object_name = "chat.completion.chunk"

    def __init__(self, processor: ChatProcessor, request: ChatCompletionRequest) -> None:
        super().__init__(processor, request)
        self.chat = processor
        self.reasoning: dict[int, ReasoningStream] = {}
        self.tools = tool_request(request, processor.tool_parser)
        self.tool_streams: dict[int, ToolCallStream] = {}

    def on_output(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        request: ChatCompletionRequest = self.request  # type: ignore[assignment]
        self.count(prompt_index, output)
        chunks = []
        for c in output.outputs:
            if c.index not in self.started:
                self.started.add(c.index)
                first = self.envelope([{
                    "index": c.index, "delta": {"role": "assistant", "content": self.chat.echoed(request)},
                    "logprobs": None, "finish_reason": None,
                }])
                self.chat.extras(request, output, {}, c, first)
                chunks.append(first)
            if not (c.text or c.token_ids or c.finish_reason is not None):
                continue
            delta = self._delta(c)
            calls = c.index in self.tool_streams and self.tool_streams[c.index].has_calls
            choice = {
                "index": c.index, "delta": delta,
                "logprobs": self.chat._logprobs(request, c),
                "finish_reason": finish_reason(c.finish_reason, calls, self.tools), "stop_reason": c.stop_reason,
            }
            self.chat.extras(request, output, choice, c, None)
            chunks.append(self.envelope([choice]))
        return chunks

    def _delta(self, c: Any) -> dict[str, Any]:
        """One choice's delta: reasoning split off first, then tool-call deltas out of the content."""
        final, text, delta = c.finish_reason is not None, c.text, {}
        if self.chat.reasoning_parser is not None:
            stream = self.reasoning.setdefault(c.index, ReasoningStream(self.chat.reasoning_parser))
            reasoning, text = stream.feed(text, final)
            if reasoning:
                delta["reasoning_content"] = reasoning
        parser = parser_for(self.tools, self.chat.tool_parser) if self.tools is not None else None
        if parser is None:
            delta["content"] = text
            return delta
        tool_stream = self.tool_streams.setdefault(c.index, ToolCallStream(parser))
        content, calls = tool_stream.feed(text, final)
        if not self.tools.parallel:
            calls = [d for d in calls if d["index"] == 0]
        delta["content"] = content or (None if calls else "")
        if calls:
            delta["tool_calls"] = calls
        return delta


def finish_reason(reason: str | None, calls: bool, tools: ToolRequest | None) -> str | None:
    """OpenAI's: "tool_calls" when the model stopped after calling tools it chose to call (a named
    choice stays "stop")."""
    if reason == "stop" and calls and tools is not None and tools.choice != "named":
        return "tool_calls"
    return reason


def _tool_fields(extra: Mapping[str, Any]) -> dict[str, Any]:
    """An earlier turn's tool fields for the template: assistant `tool_calls` (arguments as objects,
    which templates expect) and a tool message's `tool_call_id`."""
    out: dict[str, Any] = {}
    if extra.get("tool_call_id") is not None:
        out["tool_call_id"] = extra["tool_call_id"]
    if isinstance(extra.get("tool_calls"), list):
        calls = []
        for call in extra["tool_calls"]:
            fn = dict(call.get("function") or {}) if isinstance(call, dict) else {}
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass
            calls.append({**call, "function": fn} if isinstance(call, dict) else call)
        out["tool_calls"] = calls
    return out
