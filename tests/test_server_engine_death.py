"""An engine core process that dies (SIGKILL before the first request) or hangs (SIGSTOP mid-stream) behind
the HTTP server: /health turns 503 within seconds, every in-flight and later request gets an OpenAI error
body (503) instead of hanging, and no per-request state stays behind. Two spawned cores, each bounded."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from keel.config import EngineArgs

pytest.importorskip("keel_endpoints")
from keel_endpoints.testing import make_tiny_model, serve_in_thread

BODY = {"prompt": "Hello", "max_tokens": 3}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"), num_hidden_layers=1)


def _args(path, **kw) -> EngineArgs:
    return EngineArgs(model=str(path), profile="cpu", max_model_len=64, num_kv_blocks=32,
                      engine_core_process=True, **kw)


def _openai_error(r: httpx.Response, status: int, match: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"
    assert match in err["message"], err


def _wait_unhealthy(url: str, within_s: float) -> httpx.Response:
    deadline = time.monotonic() + within_s
    while True:
        r = httpx.get(f"{url}/health", timeout=5)
        if r.status_code != 200 or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def _no_request_state_left(engine) -> bool:
    return not engine._collectors and not engine.output_processor.parents and not len(engine._request_stats)


def test_core_killed_before_the_first_request(model_path):
    with serve_in_thread(_args(model_path)) as server:
        proc = server.engine.core_client._proc
        assert httpx.get(f"{server.url}/health").status_code == 200
        proc.kill()
        _openai_error(_wait_unhealthy(server.url, 3), 503, "killed by signal SIGKILL")  # today: 200 forever
        start = time.monotonic()
        _openai_error(httpx.post(f"{server.base_url}/completions", json=BODY, timeout=10), 503, "SIGKILL")
        _openai_error(httpx.post(f"{server.base_url}/completions", json={**BODY, "stream": True}, timeout=10),
                      503, "SIGKILL")
        assert time.monotonic() - start < 5
        assert _no_request_state_left(server.engine)


def test_core_stopped_mid_stream_is_killed_by_the_watchdog(model_path):
    with serve_in_thread(_args(model_path, engine_iteration_timeout_s=2)) as server:
        proc = server.engine.core_client._proc
        try:
            body = {**BODY, "max_tokens": 40, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=15) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")
                os.kill(proc.pid, signal.SIGSTOP)  # the core hangs mid-request
                start = time.monotonic()
                rest = list(lines)  # today: stalls until the client's timeout
            assert time.monotonic() - start < 10
            errors = [line for line in rest if '"error"' in line]
            assert errors and "hung" in errors[0] and "data: [DONE]" in rest
            _openai_error(_wait_unhealthy(server.url, 1), 503, "hung")
            _openai_error(httpx.post(f"{server.base_url}/completions", json=BODY, timeout=10), 503, "hung")
            proc.join(timeout=5)
            assert proc.exitcode == -signal.SIGKILL  # the watchdog does not leave a stopped process behind
            assert _no_request_state_left(server.engine)
        finally:
            if proc.is_alive():
                proc.kill()
