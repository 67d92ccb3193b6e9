"""The app without a model: endpoint plugins selected by a profile, error bodies, chat without a template.

A stub engine client stands in for AsyncLLM, so these tests need no checkpoint.
"""

from __future__ import annotations

import textwrap
import uuid

import pytest
from fastapi.testclient import TestClient
from keel_endpoints.server import build_app
from keel_endpoints.testing import StubConfig as Config
from keel_endpoints.testing import StubEngine

from keel.plugins.loader import load_plugins
from keel.profile import load_profile
from keel.testing.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _fake_endpoint_plugin(site, name: str = "hello-endpoint") -> str:
    """A third-party distribution providing an `endpoint`, installed into `site` (on sys.path)."""
    pkg = f"keel_hello_{uuid.uuid4().hex[:8]}"
    (site / pkg).mkdir()
    (site / pkg / "__init__.py").write_text(textwrap.dedent(f"""
        from keel.plugins.manifest import PluginManifest

        def manifest():
            return PluginManifest(name={name!r}, version="0.1", core_api=">=1.0,<2",
                                  provides={{"endpoint": {{"hello": "{pkg}.routes:Hello"}}}})
    """))
    (site / pkg / "routes.py").write_text(textwrap.dedent("""
        class Hello:
            def register(self, app, ctx):
                @app.get("/v1/hello")
                async def hello():
                    tok = ctx.engine_client.get_tokenizer()
                    return {"model": ctx.served_model_name, "vocab": len(tok),
                            "io_processors": [k for k, _ in ctx.io_processors]}
    """))
    info = site / "keel_hello-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: keel-hello\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[keel.plugins]\n{name} = {pkg}:manifest\n")
    return pkg


def test_third_party_endpoint_selected_by_profile(tmp_path, monkeypatch, tokenizer):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    _fake_endpoint_plugin(site)
    base = "plugins: [platform-cpu, attention-torch, models-llama, endpoints, io-processors"
    (tmp_path / "with.yaml").write_text(base + ", hello-endpoint]\n")
    (tmp_path / "without.yaml").write_text(base + "]\n")

    with_plugin = load_plugins(list(load_profile(str(tmp_path / "with.yaml")).plugins))
    app = build_app(StubEngine(tokenizer), Config, plugin_set=with_plugin, api_key="k")
    client = TestClient(app)
    r = client.get("/v1/hello", headers={"Authorization": "Bearer k"})
    assert r.json() == {"model": "stub", "vocab": len(tokenizer),
                        "io_processors": ["completion", "chat", "responses"]}
    assert client.get("/v1/hello").status_code == 401  # plugin routes are behind the API key too

    without = load_plugins(list(load_profile(str(tmp_path / "without.yaml")).plugins))
    r = TestClient(build_app(StubEngine(tokenizer), Config, plugin_set=without)).get("/v1/hello")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.fixture
def client(tokenizer):
    plugins = load_plugins(["endpoints", "io-processors"])
    return TestClient(build_app(StubEngine(tokenizer), Config, plugin_set=plugins))


def test_stub_completion_chat_and_stream(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "n": 2, "model": "stub"})
    assert [c["text"] for c in r.json()["choices"]] == ["ok", "ok"]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
    events = [line for line in r.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and r.headers["content-type"].startswith("text/event-stream")


def test_chat_with_a_model_lacking_a_template_is_400(tmp_path):
    build_tokenizer(tmp_path)
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(tmp_path)
    bare.chat_template = None
    plugins = load_plugins(["endpoints", "io-processors"])
    client = TestClient(build_app(StubEngine(bare), Config, plugin_set=plugins))
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 200


def test_metrics_logger_attached_and_health(client):
    assert client.get("/health").status_code == 200
    assert "keel:num_requests_running" in client.get("/metrics").text


def test_openai_endpoint_needs_the_io_processors(tokenizer):
    with pytest.raises(RuntimeError, match="io_processor"):
        build_app(StubEngine(tokenizer), Config, plugin_set=load_plugins(["endpoints"]))


def test_openapi_describes_every_request_body(client):
    spec = client.get("/openapi.json").json()
    bodies = {path: ops["post"]["requestBody"]["content"]["application/json"]["schema"]
              for path, ops in spec["paths"].items() if "post" in ops}
    assert set(bodies) == {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize",
                           "/v1/embeddings", "/pooling"}
    assert "prompt" in bodies["/v1/completions"]["required"] and "messages" in bodies["/v1/chat/completions"]["required"]
    assert {"max_tokens", "top_k", "logit_bias", "stream_options"} <= set(bodies["/v1/completions"]["properties"])
    top_k = bodies["/v1/completions"]["properties"]["top_k"]["anyOf"][0]
    assert top_k["maximum"] == pytest.approx(2**63 - 1)  # the ranges clients may send, as the server checks them
    assert "$defs" not in str(bodies)  # self-contained: every reference resolved
    messages = bodies["/v1/chat/completions"]["properties"]["messages"]["items"]
    assert "role" in messages["properties"] and "tokens" in bodies["/detokenize"]["properties"]
