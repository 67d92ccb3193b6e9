"""Aborts end their consumer from any thread or task; a hung engine core is reported by the watchdog.

Scripted cores (no model) on the threaded client; the engine core process variants (SIGKILL, SIGSTOP
behind the HTTP server) are in tests/test_server_engine_death.py.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from scripted_core import scripted

from keel.config import ConfigError, EngineArgs, ParallelConfig
from keel.engine.engine_client import EngineDeadError
from keel.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


def _no_request_state_left(engine) -> bool:
    return not engine._collectors and not engine.output_processor.parents and not len(engine._request_stats)


def _abort_from_a_plain_thread(engine, rid):
    threading.Thread(target=engine.abort_now, args=(rid,)).start()


def _abort_from_another_event_loop(engine, rid):
    threading.Thread(target=lambda: asyncio.run(engine.abort(rid))).start()


async def _abort_from_another_task(engine, rid):
    await asyncio.get_running_loop().create_task(engine.abort(rid))


@pytest.mark.parametrize("how", ["task", "thread", "thread-loop"])
def test_abort_ends_generate_at_once_with_a_final_abort_output(model_dir, how):
    engine, core = scripted(model_dir, step_time=0.01)

    async def run():
        gen = engine.generate("Hello", SamplingParams(max_tokens=10_000, n=2), "a")
        first = await anext(gen)
        if how == "task":
            await _abort_from_another_task(engine, "a")
        elif how == "thread":
            _abort_from_a_plain_thread(engine, "a")
        else:
            _abort_from_another_event_loop(engine, "a")
        rest = await asyncio.wait_for(_drain(gen), timeout=5)  # today: waits forever
        return first, rest

    try:
        first, rest = asyncio.run(run())
        assert not first.finished and rest and rest[-1].finished
        assert [c.finish_reason for c in rest[-1].outputs] == ["abort", "abort"]
        deadline = time.monotonic() + 5
        while core.requests and time.monotonic() < deadline:  # the core frees both children's blocks
            time.sleep(0.01)
        assert sorted(core.aborted) == ["0_a", "1_a"] and not core.requests
        assert _no_request_state_left(engine)
    finally:
        engine.shutdown()


def test_abort_of_an_unknown_or_finished_request_is_ignored(model_dir):
    engine, _core = scripted(model_dir)

    async def run():
        outs = [o async for o in engine.generate("Hello", SamplingParams(max_tokens=2), "a")]
        await engine.abort("a")
        await engine.abort("never-seen")
        return outs

    try:
        outs = asyncio.run(run())
        assert outs[-1].outputs[0].finish_reason == "length"
    finally:
        engine.shutdown()


def test_a_step_that_never_returns_fails_requests_and_health(model_dir):
    engine, core = scripted(model_dir, step_timeout_s=0.5)

    async def run():
        gen = engine.generate("Hello", SamplingParams(max_tokens=50), "a")
        await anext(gen)
        core.gate.clear()  # the next step hangs
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="hung.*engine_iteration_timeout_s=0.5"):
            await asyncio.wait_for(_drain(gen), timeout=10)
        waited = time.monotonic() - start
        with pytest.raises(EngineDeadError, match="hung"):
            await engine.check_health()
        with pytest.raises(EngineDeadError, match="hung"):
            await engine.add_request("b", "hi", SamplingParams())
        return waited

    try:
        waited = asyncio.run(run())
        assert 0.4 < waited < 5
        assert engine.errored and _no_request_state_left(engine)
    finally:
        core.gate.set()
        engine.shutdown()


def test_an_idle_core_is_not_taken_for_a_hung_one(model_dir):
    engine, _core = scripted(model_dir, step_timeout_s=0.4)

    async def run():
        await asyncio.sleep(1.2)  # idle three timeouts long: heartbeats keep it healthy
        await engine.check_health()
        return [o async for o in engine.generate("Hello", SamplingParams(max_tokens=3), "a")]

    try:
        assert asyncio.run(run())[-1].finished
    finally:
        engine.shutdown()


def test_step_timeout_is_an_engine_arg_and_validated(model_dir):
    config = EngineArgs(model=model_dir, profile="cpu", max_model_len=64,
                        engine_iteration_timeout_s=2.5).create_engine_config()
    assert config.parallel.engine_iteration_timeout_s == 2.5
    assert ParallelConfig().engine_iteration_timeout_s == 60.0
    for bad in (-1, float("nan"), "10", True):
        with pytest.raises(ConfigError, match="engine_iteration_timeout_s"):
            ParallelConfig(engine_iteration_timeout_s=bad)


async def _drain(gen) -> list:
    return [out async for out in gen]
