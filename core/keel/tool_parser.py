"""The `tool_parser` plugin kind: tool calls out of a model's text, whole or streamed.

Who calls what: the chat IO processor builds one parser per server (`cls(tokenizer)`) when the
server's `tool_call_parser` option names a key, and uses it for requests with `tools` and
`tool_choice` "auto". `parse(text, final)` says what of the text is content and which tool calls it
holds so far; a `ToolCallStream` turns successive parses of a streamed choice into OpenAI's deltas
(the first delta of a call carries its id and name, later ones fragments of its arguments, whose
concatenation is the whole arguments text). A parser only has to keep what it returns growing as text
arrives (hold back a marker that may still be arriving when `final` is False).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


@dataclass
class ParsedToolCall:
    name: str | None  # None while the name is still arriving
    arguments: str  # the arguments' JSON text so far (complete when `complete`)
    complete: bool = False


def scan_json_value(text: str, start: int) -> tuple[int, bool]:
    """From `start` (the first character of a JSON value), the end of the value and whether it is
    complete. An incomplete value runs to the end of `text` (everything there belongs to it)."""
    depth, in_string, escape = 0, False, False
    i = start
    while i < len(text):
        ch = text[i]
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1, True
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1, True
        elif depth == 0 and ch in ",\n}" and i > start:
            return i, True  # a bare number / literal ended
        i += 1
    return len(text), False


def partial_tail(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (still arriving)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def call_from_json(body: str) -> ParsedToolCall:
    """A call from the (possibly partial) JSON object text `{"name": ..., "arguments" | "parameters": ...}`."""
    m = _NAME.search(body)
    name = json.loads(f'"{m.group(1)}"') if m else None
    a = _ARGS.search(body)
    if a is None:
        return ParsedToolCall(name, "", False)
    end, complete = scan_json_value(body, a.end())
    return ParsedToolCall(name, body[a.end():end], complete)


def calls_from_json_array(text: str) -> list[ParsedToolCall]:
    """The calls of a (possibly partial) JSON array of call objects; `text` starts at the `[`."""
    calls: list[ParsedToolCall] = []
    pos = 1
    while True:
        pos += len(text[pos:]) - len(text[pos:].lstrip())
        if pos >= len(text) or text[pos] != "{":
            return calls
        stop, complete = scan_json_value(text, pos)
        calls.append(call_from_json(text[pos:stop]))
        sep = re.match(r"\s*,\s*", text[stop:]) if complete else None
        if sep is None:
            return calls
        pos = stop + sep.end()


class ToolParser:
    """Base class of `tool_parser` entries."""

    keeps_special_tokens = False  # whether its markers are special tokens the detokenizer must keep

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def parse(self, text: str, final: bool = True) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, tool calls) of `text`; with final=False `text` is a prefix of the output."""
        raise NotImplementedError


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """One streamed choice: text deltas in, (content delta, tool-call deltas) out."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content = ""
        self.ids: list[str] = []
        self.sent_args: list[int] = []  # characters of each call's arguments already sent

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        content, calls = self.parser.parse(self.text, final=final)
        content = content or ""
        new_content = content[len(self.content):] if content.startswith(self.content) else ""
        self.content = content if content.startswith(self.content) else self.content
        deltas = []
        for i, call in enumerate(calls):
            if call.name is None:
                break
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_args.append(0)
                deltas.append({"index": i, "id": self.ids[i], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            fresh = call.arguments[self.sent_args[i]:]
            if fresh:
                self.sent_args[i] = len(call.arguments)
                deltas.append({"index": i, "function": {"arguments": fresh}})
        return new_content, deltas

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)
