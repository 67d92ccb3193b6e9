"""64 concurrent streaming clients through continuous batching; client disconnects abort and free KV;
the Prometheus metrics reflect it all."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from keel.config import EngineArgs

pytest.importorskip("keel_endpoints")
from keel_endpoints.loadgen import run_load
from keel_endpoints.testing import make_tiny_model, serve_in_thread

MODEL = "tiny"
PROMPTS = ["Hello, world!", "The quick brown fox", "Once upon a time", "The river flows",
           "What is the capital", "Numbers: 1 2 3", "Learning is a journey", "In the morning"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("model"))
    args = EngineArgs(model=str(path), profile="cpu", max_model_len=256, num_kv_blocks=400, max_num_seqs=64)
    with serve_in_thread(args, served_model_name=MODEL) as s:
        yield s


def metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'^(keel:[a-z0-9_:]+)(\{[^}]*\})? (\S+)$', line)
        if m:
            key = m.group(1) + (f"[{r[1]}]" if (r := re.search(r'finished_reason="(\w+)"', m.group(2) or "")) else "")
            out[key] = float(m.group(3))
    return out


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_64_concurrent_streams_complete_and_correct(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    expected = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
                for p in PROMPTS}
    before = metrics(server)
    results = asyncio.run(run_load(server.base_url, PROMPTS, clients=64, max_tokens=12, model=MODEL,
                                   timeout=60, temperature=0, extra_body={"ignore_eos": True}))
    assert len(results) == 64
    for r in results:
        assert r.error is None, r.error
        assert r.finish_reasons == ["length"] and r.chunks_after_finish == 0
        assert r.completion_tokens == 12
        assert r.text == expected[r.prompt], r.prompt
    after = metrics(server)
    assert after["keel:request_success_total[length]"] - before["keel:request_success_total[length]"] == 64
    assert after["keel:generation_tokens_total"] - before["keel:generation_tokens_total"] == 64 * 12
    assert after["keel:time_to_first_token_seconds_count"] - before["keel:time_to_first_token_seconds_count"] == 64
    assert after["keel:inter_token_latency_seconds_count"] - before["keel:inter_token_latency_seconds_count"] \
        == 64 * 11
    assert after["keel:e2e_request_latency_seconds_count"] - before["keel:e2e_request_latency_seconds_count"] == 64
    assert after["keel:num_requests_running"] == 0 and after["keel:num_requests_waiting"] == 0
    # Prefix caching: eight clients shared each prompt.
    assert after["keel:prefix_cache_queries_total"] > before["keel:prefix_cache_queries_total"]


def _aborts(server) -> int:
    return server.engine.get_metrics()["request_success_total"].get("abort", 0)


def test_stream_disconnect_aborts_and_frees_kv_at_once(server):
    aborts = _aborts(server)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 240, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{server.base_url}/completions",
                                                       json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert metrics(server)["keel:kv_cache_usage_perc"] > 0
    # Leaving the block closed the connection mid-stream.
    assert wait_until(lambda: _aborts(server) == aborts + 1), "the request was not aborted"
    assert wait_until(lambda: metrics(server)["keel:kv_cache_usage_perc"] == 0.0)
    m = metrics(server)
    assert m["keel:num_requests_running"] == 0
    assert server.engine.get_metrics()["num_unfinished_requests"] == 0
    assert m["keel:generation_tokens_total"] > 0


def test_non_stream_disconnect_aborts(server):
    aborts = _aborts(server)
    body = {"model": MODEL, "prompt": "The river flows", "max_tokens": 240, "ignore_eos": True, "n": 8}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/completions", json=body, timeout=httpx.Timeout(30, read=0.15))
    assert wait_until(lambda: _aborts(server) >= aborts + 8), "the request was not aborted"
    assert wait_until(lambda: metrics(server)["keel:kv_cache_usage_perc"] == 0.0)


def test_metrics_exposes_vllm_names_with_keel_prefix(server):
    names = set(metrics(server))
    for name in ("keel:num_requests_running", "keel:num_requests_waiting", "keel:kv_cache_usage_perc",
                 "keel:prompt_tokens_total", "keel:generation_tokens_total", "keel:num_preemptions_total",
                 "keel:prefix_cache_queries_total", "keel:prefix_cache_hits_total",
                 "keel:request_success_total[stop]", "keel:time_to_first_token_seconds_bucket",
                 "keel:inter_token_latency_seconds_sum", "keel:e2e_request_latency_seconds_count"):
        assert name in names, name
    r = httpx.get(f"{server.url}/metrics")
    assert r.headers["content-type"].startswith("text/plain")
