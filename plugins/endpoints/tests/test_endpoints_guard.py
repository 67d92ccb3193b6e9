"""What the app does before a route runs, and after one fails: API-key scheme, content type, body size
limit, `Connection: close` on a 500 (a stub engine; no model)."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from keel_endpoints.options import ServerConfig
from keel_endpoints.server import build_app
from keel_endpoints.testing import StubConfig, StubEngine, serve_app_in_thread

from keel.plugins.loader import load_plugins
from keel.testing.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _app(tokenizer, **kwargs):
    return build_app(StubEngine(tokenizer), StubConfig, plugin_set=load_plugins(["endpoints", "io-processors"]),
                     **kwargs)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    return r.json()["error"]


def test_bearer_scheme_is_case_insensitive_the_key_is_not(tokenizer):
    client = TestClient(_app(tokenizer, api_key="Sekret"))
    for header in ("Bearer Sekret", "bearer Sekret", "BEARER Sekret", "  Bearer   Sekret "):
        r = client.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": header})
        assert r.status_code == 200, header
    for header in ("Bearer sekret", "Basic Sekret", "Sekret", "Bearer", ""):
        _error(client.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": header}), 401)


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonp"])
def test_post_needs_a_json_content_type(tokenizer, content_type):
    """What a cross-site browser form can send is refused before the body is read."""
    client = TestClient(_app(tokenizer))
    headers = {"Content-Type": content_type} if content_type else {}
    for route in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        err = _error(client.post(route, content=b'{"prompt": "hi"}', headers=headers), 415)
        assert "application/json" in err["message"]
    ok = client.post("/v1/completions", content=b'{"prompt": "hi"}',
                     headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200
    assert client.get("/health").status_code == 200  # GETs carry no body and no content type


def test_body_over_the_limit_is_413_before_it_is_read(tokenizer):
    client = TestClient(_app(tokenizer, server_config=ServerConfig(max_request_body_bytes=1000)))
    err = _error(client.post("/v1/completions", json={"prompt": "x" * 2000}), 413)
    assert "1000 bytes" in err["message"]
    assert client.post("/v1/completions", json={"prompt": "x" * 900}).status_code == 200

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 100
        yield b'"}'

    _error(client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413)


def test_huge_declared_body_is_refused_at_once(tokenizer):
    """A client announcing 100 GB gets its 413 without sending any of it."""
    with serve_app_in_thread(_app(tokenizer)) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            t0 = time.monotonic()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000000000\r\n\r\n")
            reply = sock.recv(65536)
            elapsed = time.monotonic() - t0
    head = reply.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 413") and b"connection: close" in head
    assert elapsed < 2.0


def test_a_500_closes_the_connection_and_says_so(tokenizer):
    with serve_app_in_thread(_app(tokenizer)) as url, httpx.Client(base_url=url) as client:
        assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
        r = client.post("/v1/completions", json={"prompt": "raise"})
        err = _error(r, 500)
        assert err["type"] == "server_error" and r.headers["connection"] == "close"
        # The pooled client opens a new connection for the next request instead of failing on the old one.
        for _ in range(3):
            assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
