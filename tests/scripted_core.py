"""A scripted engine core for AsyncLLM tests: no model, exact control over steps (imported by name)."""

from __future__ import annotations

import threading
import time

from keel.config import EngineArgs
from keel.engine.async_llm import AsyncLLM
from keel.engine.core_output import EngineCoreOutput, SchedulerStats
from keel.engine.engine_client import ThreadedEngineCoreClient


class ScriptedCore:
    """Emits token `token` once per step for every request until max_tokens; records what it was told."""

    def __init__(self, token: int = 262, fail_at_step: int | None = None, step_time: float = 0.0) -> None:
        self.token, self.fail_at_step, self.step_time = token, fail_at_step, step_time
        self.requests: dict[str, int] = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.thread: threading.Thread | None = None
        self.gate = threading.Event()
        self.gate.set()

    def add_request(self, request, max_tokens):
        self.requests[request.request_id] = max_tokens

    def abort_requests(self, ids):
        for rid in ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)
        return []

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.thread = threading.current_thread()
        self.gate.wait()
        time.sleep(self.step_time)
        self.steps += 1
        if self.fail_at_step == self.steps:
            raise RuntimeError("device lost")
        outs = []
        for rid in list(self.requests):
            self.requests[rid] -= 1
            done = self.requests[rid] == 0
            outs.append(EngineCoreOutput(rid, [self.token], finish_reason="length" if done else None))
            if done:
                del self.requests[rid]
        return outs

    def get_stats(self):
        return SchedulerStats(num_running_reqs=len(self.requests), kv_cache_usage=0.5 if self.requests else 0.0)


def scripted(model_dir, step_timeout_s: float | None = None, **kw) -> tuple[AsyncLLM, ScriptedCore]:
    core = ScriptedCore(**kw)
    config = EngineArgs(model=model_dir, profile="cpu", max_model_len=64).create_engine_config()
    return AsyncLLM(config, core_client=ThreadedEngineCoreClient(core, step_timeout_s)), core
