"""OpenAI's Responses API (/v1/responses, text) through the official client: the same text as the
equivalent chat completion, the streaming event sequence, usage, and 400s for what is not served."""

from __future__ import annotations

import httpx
import openai
import pytest

from keel.config import EngineArgs

pytest.importorskip("keel_endpoints")
from keel_endpoints.testing import make_tiny_model, serve_in_thread


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("model"))
    args = EngineArgs(model=str(path), profile="cpu", max_model_len=128, num_kv_blocks=64)
    with serve_in_thread(args, served_model_name="m") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def test_text_equals_the_chat_completion(client):
    r = client.responses.create(model="m", instructions="Be brief.", input="Tell me a story", max_output_tokens=6,
                                temperature=0)
    chat = client.chat.completions.create(model="m", max_completion_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}])
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    items = client.responses.create(model="m", temperature=0, max_output_tokens=6, input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me a story"}]}])
    assert items.output_text == r.output_text


def test_streaming_events(client):
    events = list(client.responses.create(model="m", input="Hello", max_output_tokens=5, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == events[-4].text and final.usage.output_tokens > 0
    plain = client.responses.create(model="m", input="Hello", max_output_tokens=5, temperature=0)
    assert plain.output_text == text


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"), ({"store": True}, "store"),
    ({"tools": [{"type": "web_search"}]}, "tools"), ({"background": True}, "background"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content"),
])
def test_what_is_not_served_is_a_400(server, extra, param):
    r = httpx.post(f"{server.base_url}/responses", json={"model": "m", "input": "hi", **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_text_format_json_schema_constrains_the_output(client):
    import json

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    r = client.responses.create(model="m", input="Give me JSON", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "obj", "schema": schema}})
    if r.status == "completed":
        value = json.loads(r.output_text)
        assert set(value) == {"a"} and isinstance(value["a"], int)
    else:  # cut at max_output_tokens: still a prefix of a valid document
        assert r.output_text.lstrip().startswith("{")
