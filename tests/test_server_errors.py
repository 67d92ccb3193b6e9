"""Every user error is an HTTP 4xx with OpenAI's error body; none is a 500, none harms the server."""

from __future__ import annotations

import httpx
import openai
import pytest

pytest.importorskip("keel_endpoints")
from keel_endpoints.testing import serve_tiny_model

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_tiny_model(tmp_path_factory.mktemp("model"), served_model_name=MODEL, max_model_len=64,
                          num_kv_blocks=64) as s:
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
    ("completions", {"prompt": [10**7]}, "prompt"),  # token id out of vocabulary
    ("completions", {"prompt": "x", "logit_bias": {"999999": 1.0}}, "logit_bias"),  # would fail inside a step
    ("completions", {"prompt": "x", "stop_token_ids": [10**7]}, "stop_token_ids"),
    ("completions", {"prompt": "x", "prompt_logprobs": 10**6}, "prompt_logprobs"),
    # Numbers past what the engine's int64 / float32 arrays hold: each used to pass validation and
    # overflow inside an engine step, killing the engine loop for every later request.
    ("completions", {"prompt": "x", "top_k": 2**63}, "top_k"),
    ("chat/completions", {**CHAT, "top_k": 2**64}, "top_k"),
    ("completions", {"prompt": "x", "min_tokens": 2**63, "max_tokens": None}, "min_tokens"),
    ("chat/completions", {**CHAT, "min_tokens": 2**63}, "min_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 2**63}, "max_tokens"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 2**70}, "max_completion_tokens"),
    ("completions", {"prompt": "x", "seed": 2**63}, "seed"),
    ("completions", {"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    ("completions", {"prompt": "x", "n": 2**63}, "n"),
    ("completions", {"prompt": "x", "best_of": 2**63}, "best_of"),
    ("completions", {"prompt": "x", "logprobs": 2**63}, "logprobs"),
    ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2**63}, "top_logprobs"),
    ("completions", {"prompt": "x", "prompt_logprobs": 2**63}, "prompt_logprobs"),
    ("completions", {"prompt": "x", "stop_token_ids": [2**63]}, "stop_token_ids.0"),
    ("completions", {"prompt": [2**64]}, "prompt"),
    ("completions", {"prompt": [[1, 2], [-1]]}, "prompt"),
    ("completions", {"prompt": "x", "logit_bias": {str(2**64): 1.0}}, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"9" * 5000: 1.0}}, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"-1": 1.0}}, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"5": 1e300}}, "logit_bias"),  # inf once in float32
    ("completions", {"prompt": "x", "temperature": 1e39}, "temperature"),
    ("completions", {"prompt": "x", "repetition_penalty": 1e39}, "repetition_penalty"),
    ("completions", {"prompt": "x", "presence_penalty": 1e308}, "presence_penalty"),
    ("completions", {"prompt": "x", "min_p": -1e-9}, "min_p"),
    ("completions", {"prompt": "x", "top_p": 1e-400}, "top_p"),  # 0.0 once parsed
    ("completions", {"prompt": "x", "truncate_prompt_tokens": 2**63}, "truncate_prompt_tokens"),
    ("completions", {"prompt": "x", "truncate_prompt_tokens": 65}, "truncate_prompt_tokens"),  # > max_model_len
    ("chat/completions", {**CHAT, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("chat/completions", {**CHAT, "stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": "x", "priority": 1}, "priority"),  # needs --scheduling-policy priority
    ("completions", {"prompt": "x", "priority": 2**63}, "priority"),
    ("chat/completions", {**CHAT, "cache_salt": ""}, "cache_salt"),
    ("completions", {"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    ("completions", {"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
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
    ("chat/completions", {**CHAT, "chat_template": "{% for %}"}, "chat_template"),  # not trusted
]


@pytest.mark.parametrize("route, body, param", BAD_BODIES)
def test_bad_values_and_types_are_400(server, route, body, param):
    err = _error(httpx.post(f"{server.base_url}/{route}", json=body), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("route", ["completions", "chat/completions", "../tokenize"])
@pytest.mark.parametrize("raw", [
    b"{not json", b"[1, 2]", b"", b"\xff\xfe", b'"a string"',
    b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",  # past Python's 4,300-digit int limit
    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # RecursionError in json
    b'{"prompt": "x", "extra": ' + b"[" * 100 + b"]" * 100 + b"}",  # deeper than the server takes
    b'{"prompt": "caf\xe9"}',  # Latin-1, not UTF-8
    b'{"prompt": "\xed\xa0\x80"}',  # an encoded surrogate: invalid UTF-8
    b'{"prompt": "\\ud800", "model": "\\udfff"}',  # escaped lone surrogates
    b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}',
    b'\xef\xbb\xbf{"prompt": "x"}',  # a byte-order mark
])
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
