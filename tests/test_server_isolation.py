"""One slow request never holds up the others: a chat template at its time budget, a long prompt."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

pytest.importorskip("keel_endpoints")
from keel_endpoints.options import ServerConfig
from keel_endpoints.server import build_app
from keel_endpoints.testing import make_tiny_model, serve_app_in_thread

from keel.config import EngineArgs
from keel.engine.async_llm import AsyncLLM
from keel.io import RequestLimits

BUDGET_S = 8.0  # long against the others' time: the render shares the GIL with them, so they run slower
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("model"))
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(path), profile="cpu", max_model_len=64, num_kv_blocks=64))
    config = ServerConfig(request_limits=RequestLimits(trust_request_chat_template=True,
                                                       chat_template_timeout_s=BUDGET_S))
    try:
        with serve_app_in_thread(build_app(engine, engine.config, server_config=config)) as u:
            yield u
    finally:
        engine.shutdown()


@pytest.mark.xfail(strict=False, reason=(
    "timing in one process: the test's client, the server's event loop, the engine core and the spinning "
    "render share one GIL, and on a 2-core CI machine the other clients took 7.6 s of the 8 s budget once; "
    "the separate-process figure is benchmarks/hostile_requests.py (another client's median 32 ms while a "
    "1e10-step template ran). The 400 at the budget is asserted in test_template_budget.py."))
def test_a_template_at_its_budget_does_not_hold_up_other_clients(url):
    slow: dict = {}

    def heavy():
        t0 = time.monotonic()
        slow["r"] = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "chat_template": LOOP})
        slow["s"] = time.monotonic() - t0

    thread = threading.Thread(target=heavy)
    thread.start()
    time.sleep(0.5)  # the template is rendering now
    t0 = time.monotonic()
    for body in ({"prompt": "Hello", "max_tokens": 2}, {"prompt": "x " * 10, "max_tokens": 1}):
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 2}, timeout=60)
    assert chat.status_code == 200
    others = time.monotonic() - t0
    thread.join()
    assert slow["r"].status_code == 400 and "time budget" in slow["r"].json()["error"]["message"]
    assert BUDGET_S - 0.5 < slow["s"] < BUDGET_S + 3
    # Before, all of them waited behind the template on the one tokenizer thread (budget - 0.5 s at least).
    assert others < BUDGET_S / 2, others
