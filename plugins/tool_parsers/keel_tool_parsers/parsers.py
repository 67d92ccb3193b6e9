"""Tool-call formats, one parser each; `keel.tool_parser` says who calls them and what they return.

hermes / qwen3   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (any number); content is the
                 text before the first call.
llama3_json      the whole output is `{"name": ..., "parameters": {...}}` (`; `-separated for several),
                 optionally after `<|python_tag|>`; anything else is content.
mistral          `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the v11 form
                 `[TOOL_CALLS]name[ARGS]{...}`; content is the text before the marker.
deepseek_v3      `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
                 <｜tool▁call▁end｜>...`; content is the text before the first marker.
A complete call whose JSON names no function makes the whole output content (as vLLM does).
"""

from __future__ import annotations

import re

from keel.tool_parser import (
    ParsedToolCall,
    ToolParser,
    call_from_json,
    calls_from_json_array,
    partial_tail,
    scan_json_value,
)

def _before(text: str, marker: str, final: bool) -> str | None:
    """Content when `marker` has not appeared: the text, less a marker that may be arriving."""
    hold = 0 if final else partial_tail(text, marker)
    return text[: len(text) - hold] or None


def _valid(content: str | None, calls: list[ParsedToolCall], text: str, final: bool):
    if final and any(c.name is None or not c.complete for c in calls):
        return (text or None), []
    return content, calls


class HermesToolParser(ToolParser):
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool = True):
        first = text.find(self.start)
        if first < 0:
            return _before(text, self.start, final), []
        calls, pos = [], first
        while pos >= 0:
            body_start = pos + len(self.start)
            stop = text.find(self.end, body_start)
            calls.append(call_from_json(text[body_start: stop if stop >= 0 else len(text)]))
            if stop < 0:
                break
            pos = text.find(self.start, stop + len(self.end))
        content = text[:first]
        return _valid(content if content.strip() else None, calls, text, final)


class Qwen3ToolParser(HermesToolParser):
    """Qwen2.5 / Qwen3 chat templates emit the hermes format."""


class Llama3JsonToolParser(ToolParser):
    tag = "<|python_tag|>"

    def parse(self, text: str, final: bool = True):
        body = text.lstrip()
        tagged = body.startswith(self.tag)
        if tagged:
            body = body[len(self.tag):].lstrip()
        elif not final and body and self.tag.startswith(body):
            return None, []
        if tagged and not body and not final:
            return None, []
        if not body.startswith("{"):
            return text or None, []
        calls, pos = [], 0
        while True:
            stop, complete = scan_json_value(body, pos)
            calls.append(call_from_json(body[pos:stop]))
            sep = re.match(r"\s*;\s*", body[stop:]) if complete else None
            if sep is None or stop + sep.end() >= len(body):
                break
            pos = stop + sep.end()
        return _valid(None, calls, text, final)


class MistralToolParser(ToolParser):
    marker = "[TOOL_CALLS]"
    keeps_special_tokens = True  # the marker is a special token

    def parse(self, text: str, final: bool = True):
        first = text.find(self.marker)
        if first < 0:
            return _before(text, self.marker, final), []
        content = text[:first] if text[:first].strip() else None
        rest = text[first + len(self.marker):].lstrip()
        calls: list[ParsedToolCall] = []
        if rest.startswith("["):  # a JSON array of calls
            calls = calls_from_json_array(rest)
        else:  # v11: name[ARGS]{...}, possibly repeated after another marker
            for part in rest.split(self.marker):
                name, sep, args = part.partition("[ARGS]")
                if not sep:
                    calls.append(ParsedToolCall(None, ""))
                    break
                stop, complete = scan_json_value(args, len(args) - len(args.lstrip()))
                calls.append(ParsedToolCall(name.strip(), args[len(args) - len(args.lstrip()):stop], complete))
        return _valid(content, calls, text, final)


class DeepSeekV3ToolParser(ToolParser):
    begin, call, sep, call_end = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    keeps_special_tokens = True

    def parse(self, text: str, final: bool = True):
        first = text.find(self.begin)
        if first < 0:
            return _before(text, self.begin, final), []
        content = text[:first] if text[:first].strip() else None
        calls: list[ParsedToolCall] = []
        for part in text[first + len(self.begin):].split(self.call)[1:]:
            _, has_sep, rest = part.partition(self.sep)
            name, newline, rest = rest.partition("\n")
            fence = rest.find("```json")
            if not (has_sep and newline) or fence < 0:
                calls.append(ParsedToolCall(None, ""))
                break
            start = fence + len("```json")
            start += len(rest[start:]) - len(rest[start:].lstrip())
            stop, complete = scan_json_value(rest, start)
            calls.append(ParsedToolCall(name.strip(), rest[start:stop], complete))
        return _valid(content, calls, text, final)
