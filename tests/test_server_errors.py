"""Every user error is an HTTP 4xx with OpenAI's error body; none is a 500, none harms the server."""

from __future__ import annotations

import httpx
import openai
import pytest

from keel.config import EngineArgs

pytest.importorskip("keel_endpoints")
from keel_endpoints.testing import make_tiny_model, serve_in_thread

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("model"))
    args = EngineArgs(model=str(path), profile="cpu", max_model_len=64, num_kv_blocks=64)
    with serve_in_thread(args, served_model_name=MODEL) as s:
        yield s


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
BAD_BODIES = [
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "x", "top_p": 1.01}, "top_p"),
    ("completions", {"prompt": "x", "n": 0}, "n"),
    ("completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("completions", {"prompt": "x", "frequency_penalty": 9}, "frequency_penalty"),
    ("completions", {"prompt": "x", "top_k": -3}, "top_k"),
    ("completions", {"prompt": "x", "stop": [1, 2]}, "stop"),
    ("completions", {"prompt": "x", "stream_options": "yes"}, "stream_options"),
    ("completions", {"prompt": None}, "prompt"),
    ("completions", {"prompt": [10**7]}, None),  # token id out of vocabulary
    ("completions", {"prompt": "x", "logit_bias": {"999999": 1.0}}, None),  # would fail inside a step
    ("completions", {"prompt": "x", "stop_token_ids": [10**7]}, None),
    ("completions", {"prompt": "x", "prompt_logprobs": 10**6}, None),
    # prompt fits, prompt + max_tokens does not: OpenAI's 400, not a silently shorter completion
    ("completions", {"prompt": [5] * 60, "max_tokens": 10}, "max_tokens"),
    ("completions", {"prompt": [5] * 55}, "max_tokens"),  # the default max_tokens (16) counts too
    ("completions", {"prompt": "hello " * 10, "max_tokens": 60}, "max_tokens"),  # text: tokenized first
    ("chat/completions", {**CHAT, "max_tokens": 64}, "max_tokens"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 64}, "max_completion_tokens"),
    ("completions", {"max_tokens": 3}, "prompt"),
    ("chat/completions", {**CHAT, "max_tokens": -1}, "max_tokens"),
    ("chat/completions", {**CHAT, "messages": []}, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": {"a": 1}}]}, "messages.0.content"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content"),
    ("chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("chat/completions", {**CHAT, "chat_template": "{% for %}"}, "messages"),  # template error
]


@pytest.mark.parametrize("route, body, param", BAD_BODIES)
def test_bad_values_and_types_are_400(server, route, body, param):
    err = _error(httpx.post(f"{server.base_url}/{route}", json=body), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("route", ["completions", "chat/completions", "../tokenize"])
@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b"\xff\xfe", b'"a string"'])
def test_malformed_json_is_400(server, route, raw):
    _error(httpx.post(f"{server.base_url}/{route}", content=raw, headers={"Content-Type": "application/json"}), 400)


def test_prompt_longer_than_max_model_len_is_400(server):
    err = _error(httpx.post(f"{server.base_url}/completions", json={"prompt": "hello " * 200}), 400)
    assert "max_model_len" in err["message"]
    stream = httpx.post(f"{server.base_url}/completions", json={"prompt": "hello " * 200, "stream": True})
    _error(stream, 400)  # a stream is validated before it starts
    chat = [{"role": "user", "content": "hello " * 200}]
    _error(httpx.post(f"{server.base_url}/chat/completions", json={"messages": chat}), 400)


def test_unknown_model_is_404(server):
    err = _error(httpx.post(f"{server.base_url}/completions", json={"prompt": "x", "model": "gpt-4"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0).chat.completions.create(
            model="other", messages=CHAT["messages"])


def test_unknown_route_and_method_use_the_error_body(server):
    _error(httpx.get(f"{server.base_url}/nothing-here"), 404)
    _error(httpx.get(f"{server.base_url}/completions"), 405)


def test_openai_client_raises_bad_request(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", top_p=2.0)
    assert err.value.status_code == 400 and err.value.body["param"] == "top_p"


def test_errors_never_harm_the_server_or_other_requests(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    before = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0).choices[0].text
    for route, body, _ in BAD_BODIES:
        httpx.post(f"{server.base_url}/{route}", json=body)
    after = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0).choices[0].text
    assert before == after
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.engine.get_metrics()["num_unfinished_requests"] == 0
