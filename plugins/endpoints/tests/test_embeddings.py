"""Embedding models through the pooling runner path: vectors equal transformers' on the same weights
(float32, batch mixes, chunked prefill), and /v1/embeddings + /pooling serve them."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import openai
import pytest
import torch
from keel_endpoints.testing import serve_in_thread

from keel.config import EngineArgs
from keel.engine.async_llm import AsyncLLM
from keel.engine.pooling_params import PoolingParams
from keel.testing.checkpoints import make_checkpoint
from keel.testing.tokenizer import build_tokenizer

PROMPTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog again and again", "a",
           "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12"]


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("embed")
    tok = build_tokenizer(path, vocab_size=512)
    make_checkpoint("llama-embed", path, vocab_size=len(tok))
    return path


def hf_embeddings(path, token_ids: list[list[int]], pooling: str = "last") -> list[np.ndarray]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in token_ids:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            v = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
            out.append(torch.nn.functional.normalize(v, dim=-1).numpy())
    return out


def encode_all(engine: AsyncLLM, prompts) -> list:
    async def run():
        async def one(i, p):
            return [o async for o in engine.encode(p, PoolingParams(), f"r{i}")][-1]
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return asyncio.run(run())


@pytest.mark.parametrize("chunk, async_scheduling", [(None, False), (8, False), (8, True)])
def test_vectors_equal_transformers(embed_dir, chunk, async_scheduling):
    extra = {"max_num_batched_tokens": chunk, "max_num_seqs": 4} if chunk else {}
    extra["async_scheduling"] = async_scheduling
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(embed_dir), profile="cpu", max_model_len=64,
                                                  dtype="float32", **extra))
    try:
        assert engine.is_pooling_model
        outs = encode_all(engine, PROMPTS)
        ref = hf_embeddings(embed_dir, [o.prompt_token_ids for o in outs])
        for out, want in zip(outs, ref):
            assert out.finished and out.outputs.data.shape == want.shape
            np.testing.assert_allclose(out.outputs.data.numpy(), want, atol=1e-4)
        m = engine.get_metrics()
        assert m["num_requests_running"] == 0 and m["kv_cache_usage"] == 0.0
    finally:
        engine.shutdown()


def test_mean_pooling_from_a_sentence_transformers_config(tmp_path, embed_dir):
    import shutil

    path = tmp_path / "mean"
    shutil.copytree(embed_dir, path)
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(path), profile="cpu", max_model_len=64, dtype="float32"))
    try:
        outs = encode_all(engine, PROMPTS[:2])
        ref = hf_embeddings(path, [o.prompt_token_ids for o in outs], pooling="mean")
        for out, want in zip(outs, ref):
            np.testing.assert_allclose(out.outputs.data.numpy(), want, atol=1e-4)
    finally:
        engine.shutdown()


def test_embeddings_and_pooling_routes(embed_dir):
    args = EngineArgs(model=str(embed_dir), profile="cpu", max_model_len=64, dtype="float32")
    with serve_in_thread(args, served_model_name="emb") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        r = client.embeddings.create(model="emb", input=PROMPTS[:2])
        assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens > 0
        ids = [server.engine.tokenizer.encode(p) for p in PROMPTS[:2]]
        for d, want in zip(r.data, hf_embeddings(embed_dir, ids)):
            np.testing.assert_allclose(d.embedding, want, atol=1e-4)
        b64 = httpx.post(f"{server.base_url}/embeddings", json={"input": PROMPTS[0], "encoding_format": "base64"})
        vec = np.frombuffer(base64.b64decode(b64.json()["data"][0]["embedding"]), dtype="<f4")
        np.testing.assert_allclose(vec, r.data[0].embedding, atol=1e-6)
        pooled = httpx.post(f"{server.url}/pooling", json={"input": [ids[0]]}).json()
        assert pooled["data"][0]["object"] == "pooling"
        np.testing.assert_allclose(pooled["data"][0]["data"], r.data[0].embedding, atol=1e-6)
        for body, param in (({"input": "x", "dimensions": 8}, "dimensions"),
                            ({"input": "x", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
                            ({"input": []}, "input")):
            bad = httpx.post(f"{server.base_url}/embeddings", json=body)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
        gen = httpx.post(f"{server.base_url}/completions", json={"prompt": "hi", "max_tokens": 2})
        assert gen.status_code == 400 and "embedding" in gen.json()["error"]["message"]


def test_a_generation_model_refuses_embeddings(tmp_path):
    from fastapi.testclient import TestClient
    from keel_endpoints.server import build_app
    from keel_endpoints.testing import StubConfig, StubEngine

    from keel.plugins.loader import load_plugins

    app = build_app(StubEngine(build_tokenizer(tmp_path)), StubConfig,
                    plugin_set=load_plugins(["endpoints", "io-processors"]))
    r = TestClient(app).post("/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 400 and "generation model" in r.json()["error"]["message"]


def test_offline_generation_on_an_embedding_model_is_refused_before_queuing(embed_dir):
    from keel import LLM, SamplingParams

    llm = LLM(model=str(embed_dir), max_model_len=64)
    with pytest.raises(ValueError, match="embedding"):
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.get_metrics()["num_requests_waiting"] == 0
