"""Tool calling through the OpenAI server and the official client.

Named and "required" choices are enforced by structured outputs on a real (random) model, so their calls
always parse, whole and streamed. "auto" needs a model that writes calls: a stub engine replays a
hermes-format answer in small pieces, so the parser's streaming deltas are checked exactly.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from keel.config import EngineArgs
from keel.testing.tokenizer import whitespace_ban
from keel.engine.outputs import CompletionOutput, RequestOutput

pytest.importorskip("keel_endpoints")
from keel_endpoints.server import build_app  # noqa: E402
from keel_endpoints.testing import make_tiny_model, serve_app_in_thread, serve_in_thread  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("model"))
    args = EngineArgs(model=str(path), profile="cpu", max_model_len=256, num_kv_blocks=128, max_num_seqs=8)
    with serve_in_thread(args, served_model_name="m") as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def no_whitespace(served):
    return whitespace_ban(served.engine.get_tokenizer())


def collect(stream) -> tuple[dict[int, dict[str, Any]], str | None]:
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or ():
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                call["id"], call["name"] = d.id, d.function.name
            call["arguments"] += d.function.arguments or ""
    return calls, finish


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_choices_always_parse(client, no_whitespace, choice):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    kw = {"model": "m", "messages": MESSAGES, "tools": [WEATHER, TIME], "tool_choice": tool_choice,
          "max_tokens": 120, "temperature": 0, "logit_bias": no_whitespace}
    out = client.chat.completions.create(**kw).choices[0]
    calls = out.message.tool_calls
    assert calls and out.finish_reason == ("stop" if choice == "named" else "tool_calls"), out
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert args["city"] in ("Paris", "Tokyo") and args["days"] in (1, 2, 3)
        else:
            assert call.function.name == "get_time" and args["zone"] in ("UTC", "CET")
    streamed, finish = collect(client.chat.completions.create(stream=True, **kw))
    assert finish == out.finish_reason
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (c.function.name, c.function.arguments) for c in calls]


def test_tool_requests_that_cannot_be_served_are_400s(client):
    base = {"model": "m", "messages": MESSAGES, "max_tokens": 4}
    for extra, words in [
        ({"tools": [WEATHER]}, "tool-call parser"),  # auto without --tool-call-parser
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [{"type": "function"}]}, "tools.0"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "combined"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**base, **extra)
        assert words in err.value.message, (extra, err.value.message)
    # tool_choice "none": plain content, tools only rendered
    out = client.chat.completions.create(**base, tools=[WEATHER], tool_choice="none").choices[0]
    assert out.message.tool_calls is None and out.finish_reason == "length"


HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


class ReplayEngine:
    """An engine client that answers every request with HERMES, in 3-character deltas."""

    max_model_len = 256

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_stat_logger(self, _: Any) -> None:
        pass

    async def run_in_tokenizer_thread(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    async def check_health(self) -> None:
        return None

    async def generate(self, prompt: Any, params: Any, request_id: str, *, output_kind: Any) -> AsyncIterator[Any]:
        from keel.engine.output_processor import RequestOutputKind

        ids = prompt.get("prompt_token_ids") or []
        if output_kind is not RequestOutputKind.DELTA:
            yield RequestOutput(request_id, None, ids, None, [CompletionOutput(0, HERMES, [5], None, None, "stop")], True)
            return
        pieces = [HERMES[i : i + 3] for i in range(0, len(HERMES), 3)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield RequestOutput(request_id, None, ids, None,
                                [CompletionOutput(0, piece, [5], None, None, "stop" if last else None)], last)


def test_auto_choice_with_the_hermes_parser(served):
    config = served.engine.config
    options = type("C", (), {"model": config.model, "plugin_options": {"tool_call_parser": "hermes"}})()
    app = build_app(ReplayEngine(served.engine.get_tokenizer()), options, plugin_set=config.plugin_set(),
                    served_model_name="m")
    with serve_app_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        kw = {"model": "m", "messages": MESSAGES, "tools": [WEATHER, TIME]}
        out = client.chat.completions.create(**kw).choices[0]
        assert out.finish_reason == "tool_calls" and out.message.content == "Let me look.\n"
        whole = [(c.function.name, json.loads(c.function.arguments)) for c in out.message.tool_calls]
        assert whole == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]
        stream = list(client.chat.completions.create(stream=True, **kw))
        content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        calls, finish = collect(iter(stream))
        assert content == "Let me look.\n" and finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == whole
        assert len({c["id"] for c in calls.values()}) == 2


def test_offline_chat_renders_tools(tmp_path):
    from keel import LLM, SamplingParams

    path = make_tiny_model(tmp_path / "m")
    template = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, block_size=8)
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=2), use_tqdm=False, chat_template=template, tools=[WEATHER])
    assert "get_weather" in llm.get_tokenizer().decode(out[0].prompt_token_ids)
    llm.shutdown()
