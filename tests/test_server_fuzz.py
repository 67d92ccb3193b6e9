"""Fuzzing the running server (tiny model, real engine): no request may get a 5xx, every error is an
OpenAI error body, and afterwards the server still serves a plain request.

Bodies are built from the request schemas the server publishes in /openapi.json: every documented field,
with boundary numbers (int64 / float32 edges, huge, negative), wrong types and nested junk, plus raw-byte
mutations (truncation, invalid UTF-8, deep nesting, huge integer literals) and wrong content types.
Bounded: `FUZZ_EXAMPLES` cases, derandomized (the same cases on every run).
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("keel_endpoints")
from keel_endpoints.testing import serve_tiny_model

FUZZ_EXAMPLES = 2000
MODEL = "tiny"
ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]

INTS = st.sampled_from([0, 1, -1, 2, 3, 31, 32, 33, 127, 128, 129, 511, 512, 2**31 - 1, 2**31, 2**32, 2**53 + 1,
                        2**63 - 1, 2**63, 2**64, -(2**63), -(2**63) - 1, 10**30]) | st.integers(-3, 40)
FLOATS = st.sampled_from([0.0, -0.0, 1e-320, 1e-6, 0.5, 1.0, 1.5, 2.0, 2.5, 100.0, 100.5, 1e38, 3.5e38, 1e308,
                          -1e308, -2.0, -100.0]) | st.floats(-5, 5, allow_nan=False)
SCALARS = st.none() | st.booleans() | INTS | FLOATS | st.text(max_size=12)
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                           max_size=3), max_leaves=8)
TEXT = st.sampled_from(["", "Hello", "x", "\u00e9\u4e2d\U0001f600", "<|im_start|>", "\x00", " " * 40]) | st.text(
    max_size=20)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | JUNK,
                                 "content": TEXT | JUNK | st.lists(st.fixed_dictionaries(
                                     {"type": st.sampled_from(["text", "image_url"]), "text": TEXT | JUNK}),
                                     max_size=2)})
PROMPT = TEXT | st.lists(INTS, max_size=4) | st.lists(TEXT, max_size=3) | st.lists(st.lists(INTS, max_size=3),
                                                                                    max_size=2) | JUNK
RAW_JUNK = st.sampled_from([b"", b"{", b"[]", b"null", b"\xff\xfe\x00", b'{"prompt": "\xed\xa0\x80"}',
                            b'{"prompt": "\\ud800"}', b'{"prompt": "x", "n": NaN}', b'{"prompt": 1e999}',
                            b'{"prompt": "x", "max_tokens": ' + b"7" * 5000 + b"}",
                            b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", b"\xef\xbb\xbf{}"])


def _field_values(field: str) -> st.SearchStrategy:
    special = {"logit_bias": st.dictionaries(st.sampled_from(["5", "-1", "0", "511", "512", str(2**63), "x", "9" * 30]),
                                             FLOATS | INTS | JUNK, max_size=3),
               "stop": TEXT | st.lists(TEXT, max_size=3) | JUNK,
               "stop_token_ids": st.lists(INTS, max_size=3) | JUNK,
               "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JUNK}) | JUNK,
               "tokens": st.lists(INTS, max_size=4) | JUNK,
               "chat_template_kwargs": st.dictionaries(st.text(max_size=8), JUNK, max_size=2) | JUNK}
    return special.get(field, INTS | FLOATS | SCALARS | JUNK)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_tiny_model(tmp_path_factory.mktemp("model"), served_model_name=MODEL, max_model_len=32,
                          num_kv_blocks=64) as s:
        yield s


def _schemas(server) -> dict[str, dict]:
    spec = httpx.get(f"{server.url}/openapi.json").json()
    return {route: spec["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
            for route in ROUTES}


def _check(r: httpx.Response, seen: dict[str, int]) -> None:
    seen["requests"] += 1
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event), event  # no failure inside a stream


def test_fuzzed_requests_never_get_a_5xx(server):
    schemas = _schemas(server)
    fields = {route: sorted(schema["properties"]) for route, schema in schemas.items()}
    seen = {"requests": 0}
    client = httpx.Client(base_url=server.url, timeout=60)

    @st.composite
    def requests(draw):
        route = draw(st.sampled_from(ROUTES))
        required = {"/v1/completions": {"prompt": PROMPT}, "/v1/chat/completions": {"messages": st.lists(
            MESSAGE, max_size=3) | JUNK}, "/tokenize": {"prompt": TEXT}, "/detokenize": {"tokens": st.lists(INTS)}}
        body = {k: draw(v) for k, v in required[route].items() if draw(st.integers(0, 9)) > 0}
        for name in draw(st.lists(st.sampled_from(fields[route]), max_size=5, unique=True)):
            body[name] = draw(_field_values(name))
        # Keep generation short (huge and invalid lengths come from the fields above).
        if route == "/v1/completions" and "max_tokens" not in body:
            body["max_tokens"] = draw(st.integers(1, 3))
        if route == "/v1/chat/completions" and not {"max_tokens", "max_completion_tokens"} & set(body):
            body["max_completion_tokens"] = draw(st.integers(1, 3))
        raw = json.dumps(body).encode()
        mutation = draw(st.integers(0, 19))
        if mutation == 0:
            raw = draw(RAW_JUNK)
        elif mutation == 1:
            raw = raw[: draw(st.integers(0, max(len(raw) - 1, 0)))]
        elif mutation == 2:
            at = draw(st.integers(0, len(raw)))
            raw = raw[:at] + draw(st.binary(min_size=1, max_size=3)) + raw[at:]
        content_type = "application/json" if draw(st.integers(0, 19)) else draw(
            st.sampled_from(["text/plain", "application/x-www-form-urlencoded", ""]))
        return route, raw, content_type

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(requests())
    def fuzz(case):
        route, raw, content_type = case
        _check(client.post(route, content=raw, headers={"Content-Type": content_type} if content_type else {}), seen)

    fuzz()
    assert seen["requests"] >= FUZZ_EXAMPLES
    plain = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3})
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 3
    assert client.get("/health").status_code == 200
    assert server.engine.get_metrics()["num_unfinished_requests"] == 0
    client.close()
