"""Every tool-call format: content and calls from whole outputs, and OpenAI-style deltas from every
chunking whose concatenation equals the whole parse."""

from __future__ import annotations

import json

import pytest
from keel_tool_parsers.parsers import (
    DeepSeekV3ToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    Qwen3ToolParser,
)

from keel.plugins.loader import load_plugins
from keel.tool_parser import ToolCallStream

ARGS1, ARGS2 = '{"city": "Paris", "days": [1, 2], "note": "a \\"}\\" b"}', '{"q": 3.5}'
CASES = [
    (HermesToolParser, f'Sure.\n<tool_call>\n{{"name": "weather", "arguments": {ARGS1}}}\n</tool_call>\n'
                       f'<tool_call>{{"name": "calc", "arguments": {ARGS2}}}</tool_call>', "Sure.\n"),
    (Qwen3ToolParser, f'<tool_call>\n{{"name": "weather", "arguments": {ARGS1}}}\n</tool_call>'
                      f'<tool_call>\n{{"name": "calc", "arguments": {ARGS2}}}\n</tool_call>', None),
    (Llama3JsonToolParser, f'<|python_tag|>{{"name": "weather", "parameters": {ARGS1}}}; '
                           f'{{"name": "calc", "parameters": {ARGS2}}}', None),
    (MistralToolParser, f'Ok [TOOL_CALLS][{{"name": "weather", "arguments": {ARGS1}}}, '
                        f'{{"name": "calc", "arguments": {ARGS2}}}]', "Ok "),
    (MistralToolParser, f'[TOOL_CALLS]weather[ARGS]{ARGS1}[TOOL_CALLS]calc[ARGS]{ARGS2}', None),
    (DeepSeekV3ToolParser, "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n"
                           f"```json\n{ARGS1}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calc\n"
                           f"```json\n{ARGS2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Let me check."),
]


def test_registered():
    reg = load_plugins(["tool-parsers"]).registry("tool_parser")
    assert sorted(reg.keys()) == ["deepseek_v3", "hermes", "llama3_json", "mistral", "qwen3"]


@pytest.mark.parametrize("cls, text, content", CASES)
def test_whole_output(cls, text, content):
    got_content, calls = cls().parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", json.loads(ARGS1)), ("calc", json.loads(ARGS2))]


@pytest.mark.parametrize("cls, text, content", CASES)
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_streamed_deltas_add_up(cls, text, content, chunk):
    stream = ToolCallStream(cls())
    pieces = [text[i : i + chunk] for i in range(0, len(text), chunk)]
    got_content, calls = "", {}
    for i, piece in enumerate(pieces):
        dc, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        got_content += dc
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": "", "id": None})
            if "id" in d:
                assert call["id"] is None and d["function"]["arguments"] == ""
                call["id"], call["name"] = d["id"], d["function"]["name"]
            call["arguments"] += d["function"]["arguments"]
    assert (got_content or None) == content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("weather", json.loads(ARGS1)), ("calc", json.loads(ARGS2))]


@pytest.mark.parametrize("cls", [HermesToolParser, Llama3JsonToolParser, MistralToolParser, DeepSeekV3ToolParser])
def test_plain_text_and_broken_calls_are_content(cls):
    assert cls().parse("Just words.") == ("Just words.", [])
    broken = {HermesToolParser: '<tool_call>{"nam": 1}</tool_call>', Llama3JsonToolParser: '{"x": 1}',
              MistralToolParser: '[TOOL_CALLS][{"arguments": {}}]',
              DeepSeekV3ToolParser: "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"}[cls]
    assert cls().parse(broken) == (broken, [])
