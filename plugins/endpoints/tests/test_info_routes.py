"""GET /v1/models/{id}, /tokenizer_info (behind vLLM's flag) and /docs."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from keel_endpoints.options import ServerConfig
from keel_endpoints.server import build_app
from keel_endpoints.testing import StubConfig, StubEngine

from keel.plugins.loader import load_plugins
from keel.testing.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def client(tokenizer, **options) -> TestClient:
    plugins = load_plugins(["endpoints", "io-processors"])
    return TestClient(build_app(StubEngine(tokenizer), StubConfig, plugin_set=plugins,
                                server_config=ServerConfig(**options)))


def test_model_by_id(tokenizer):
    c = client(tokenizer)
    card = c.get("/v1/models/stub").json()
    assert card["id"] == "stub" and card["object"] == "model" and card == c.get("/v1/models").json()["data"][0]
    r = c.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_tokenizer_info_only_when_enabled(tokenizer):
    assert client(tokenizer).get("/tokenizer_info").status_code == 404
    info = client(tokenizer, enable_tokenizer_info_endpoint=True).get("/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["chat_template"] == tokenizer.chat_template and "eos_token" in info


def test_docs_are_served(tokenizer):
    c = client(tokenizer)
    assert c.get("/docs").status_code == 200 and "swagger" in c.get("/docs").text.lower()
    assert c.get("/redoc").status_code == 200
    assert "/v1/models/{model_id}" in c.get("/openapi.json").json()["paths"]
