"""Run a real keel API server on a free loopback port in a background thread (for tests and scripts).

    with serve_in_thread(EngineArgs(model=path, profile="cpu"), api_key="k") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="k")
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from keel.config import EngineArgs
from keel.engine.async_llm import AsyncLLM
from keel.engine.outputs import CompletionOutput, RequestOutput
from keel.testing.tokenizer import make_tiny_model  # noqa: F401  (re-exported for the server tests)
from keel_endpoints.server import build_app


@dataclass
class RunningServer:
    url: str  # http://127.0.0.1:PORT
    engine: AsyncLLM
    app: Any

    @property
    def base_url(self) -> str:
        """The OpenAI client's base_url."""
        return f"{self.url}/v1"


@contextlib.contextmanager
def serve_app_in_thread(app: Any, startup_timeout: float = 30.0) -> Iterator[str]:
    """Serve `app` with uvicorn on 127.0.0.1 (a port the OS picks); yields the base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=30))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="keel-test-server",
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextlib.contextmanager
def serve_in_thread(args: EngineArgs, *, api_key: str | None = None,
                    served_model_name: str | None = None) -> Iterator[RunningServer]:
    """An AsyncLLM for `args` behind the full app (every endpoint of the profile's plugins)."""
    engine = AsyncLLM.from_engine_args(args)
    try:
        app = build_app(engine, engine.config, api_key=api_key, served_model_name=served_model_name)
        with serve_app_in_thread(app) as url:
            yield RunningServer(url=url, engine=engine, app=app)
    finally:
        engine.shutdown()


@contextlib.contextmanager
def serve_tiny_model(directory: Any, *, served_model_name: str = "tiny", api_key: str | None = None,
                     **engine_args: Any) -> Iterator[RunningServer]:
    """`make_tiny_model(directory)` served on the CPU profile with `engine_args` (max_model_len, ...)."""
    path = make_tiny_model(directory)
    args = EngineArgs(model=str(path), profile="cpu", **engine_args)
    with serve_in_thread(args, api_key=api_key, served_model_name=served_model_name) as server:
        yield server


class StubEngine:
    """An engine client without a model, for app tests: answers every request with the completion "ok"
    (2 tokens); a prompt of "raise" makes `generate` fail as an engine bug would."""

    max_model_len = 64

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.loggers: list[Any] = []

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_stat_logger(self, stat_logger: Any) -> None:
        self.loggers.append(stat_logger)

    async def run_in_tokenizer_thread(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    async def check_health(self) -> None:
        return None

    async def generate(self, prompt: Any, params: Any, request_id: str, *, output_kind: Any,
                       priority: int = 0) -> AsyncIterator[Any]:
        if prompt.get("prompt") == "raise":
            raise RuntimeError("stub engine failure")
        ids = prompt.get("prompt_token_ids") or self.tokenizer.encode(prompt["prompt"])
        yield RequestOutput(request_id, prompt.get("prompt"), list(ids), None,
                            [CompletionOutput(i, "ok", [5, 6], None, None, "stop") for i in range(params.n)], True)


class StubConfig:
    class model:
        model = "stub"
        served_model_name = "stub"
