"""AsyncLLM and the threaded engine-core client: plumbing with a scripted core, then the real engine."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from scripted_core import scripted

from keel.config import EngineArgs
from keel.engine.async_llm import AsyncLLM
from keel.engine.engine_client import EngineClient, EngineCoreClient, EngineDeadError
from keel.engine.llm_engine import LLMEngine
from keel.engine.output_processor import RequestOutputKind
from keel.engine.processor import PromptTooLongError
from keel.engine.sampling_params import SamplingParams
from keel.testing.checkpoints import make_checkpoint
from keel.testing.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    make_checkpoint("llama", path, vocab_size=512)
    build_tokenizer(path)
    return str(path)


def test_protocols_are_implemented(model_dir):
    engine, _ = scripted(model_dir)
    try:
        assert isinstance(engine, EngineClient) and isinstance(engine.core_client, EngineCoreClient)
    finally:
        engine.shutdown()


def test_generate_streams_deltas_from_the_core_thread(model_dir):
    engine, core = scripted(model_dir, step_time=0.02)

    async def run():
        outs = [o async for o in engine.generate("Hello", SamplingParams(max_tokens=4), "a")]
        return outs

    try:
        outs = asyncio.run(run())
        assert [len(o.outputs[0].token_ids) for o in outs] == [1, 1, 1, 1]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert core.thread is not None and core.thread is not threading.main_thread()
        assert engine.get_metrics()["num_unfinished_requests"] == 0
    finally:
        engine.shutdown()


def test_slow_consumer_gets_merged_deltas(model_dir):
    # Steps of 10 ms: the first delta is read before the core has run all six (at 0 ms a loaded machine
    # let the core finish first, and the first output held every token); all are done within the sleep.
    engine, _core = scripted(model_dir, step_time=0.01)

    async def run():
        gen = engine.generate("Hello", SamplingParams(max_tokens=6), "a", output_kind=RequestOutputKind.DELTA)
        first = await anext(gen)
        await asyncio.sleep(0.2)  # the core finishes meanwhile; pending deltas are merged, none lost
        rest = [o async for o in gen]
        return first, rest

    try:
        first, rest = asyncio.run(run())
        tokens = first.outputs[0].token_ids + [t for o in rest for t in o.outputs[0].token_ids]
        assert tokens == [262] * 6 and len(rest) < 5 and rest[-1].finished
    finally:
        engine.shutdown()


def test_leaving_generate_early_aborts_in_the_core(model_dir):
    engine, core = scripted(model_dir)

    async def run():
        gen = engine.generate("Hello", SamplingParams(max_tokens=50, n=2), "a")
        await anext(gen)
        await gen.aclose()
        for _ in range(100):
            if not core.requests:
                break
            await asyncio.sleep(0.01)

    try:
        asyncio.run(run())
        assert sorted(core.aborted) == ["0_a", "1_a"] and not core.requests
    finally:
        engine.shutdown()


def test_validation_errors_queue_nothing(model_dir):
    engine, core = scripted(model_dir)

    async def run():
        with pytest.raises(PromptTooLongError):
            await engine.add_request("a", "hello " * 100, SamplingParams())
        with pytest.raises(ValueError, match="vocabulary"):
            await engine.add_request("b", [10**6], SamplingParams())
        core.gate.clear()  # hold the core so "c" stays in flight
        await engine.add_request("c", "hi", SamplingParams(max_tokens=3))
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("c", "hi", SamplingParams(max_tokens=3))
        core.gate.set()

    try:
        asyncio.run(run())
        assert list(core.requests) in (["c"], [])
    finally:
        core.gate.set()
        engine.shutdown()


def test_a_dead_engine_fails_pending_and_new_requests(model_dir):
    engine, _core = scripted(model_dir, fail_at_step=2)

    async def run():
        with pytest.raises(EngineDeadError, match="device lost"):
            async for _ in engine.generate("Hello", SamplingParams(max_tokens=10), "a"):
                pass
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await engine.add_request("b", "hi", SamplingParams())

    try:
        asyncio.run(run())
        assert engine.errored
    finally:
        engine.shutdown()


@pytest.mark.parametrize("engine_core_process", [False, True], ids=["core-thread", "core-process"])
def test_matches_the_synchronous_engine_and_frees_kv(model_dir, engine_core_process):
    args = {"model": model_dir, "profile": "cpu", "max_model_len": 128, "num_kv_blocks": 64}
    prompts = ["Hello world", "The quick brown fox", "Once upon a time"]
    params = SamplingParams(max_tokens=8, temperature=0, stop=["zz"])
    sync = LLMEngine.from_engine_args(EngineArgs(**args))
    for i, p in enumerate(prompts):
        sync.add_request(str(i), p, params)
    expected: dict[str, str] = {}
    while sync.has_unfinished_requests():
        for out in sync.step():
            expected[out.request_id] = out.outputs[0].text
    engine = AsyncLLM.from_engine_args(EngineArgs(**args, engine_core_process=engine_core_process))
    if engine_core_process:
        from keel.engine.process_client import ProcessEngineCoreClient

        assert isinstance(engine.core_client, ProcessEngineCoreClient)

    async def one(i, p):
        text = ""
        async for out in engine.generate(p, params, str(i)):
            text += out.outputs[0].text
        return text

    async def run():
        texts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        gen = engine.generate("A long one", SamplingParams(max_tokens=100, ignore_eos=True), "long")
        await anext(gen)
        assert engine.get_metrics()["kv_cache_usage"] > 0
        await gen.aclose()
        # An abort from another thread ends its consumer at once with vLLM's final "abort" output.
        gen = engine.generate("Another", SamplingParams(max_tokens=100, ignore_eos=True, n=2), "long2")
        await anext(gen)
        threading.Thread(target=engine.abort_now, args=("long2",)).start()
        rest = await asyncio.wait_for(_drain(gen), timeout=5)
        assert rest[-1].finished and [c.finish_reason for c in rest[-1].outputs] == ["abort", "abort"]
        for _ in range(200):
            if engine.get_metrics()["kv_cache_usage"] == 0 and engine.get_metrics()["num_requests_running"] == 0:
                break
            await asyncio.sleep(0.01)
        return texts

    try:
        texts = asyncio.run(run())
        assert texts == [expected[str(i)] for i in range(len(prompts))]
        m = engine.get_metrics()
        assert m["kv_cache_usage"] == 0 and m["num_requests_running"] == 0
        assert m["request_success_total"].get("abort") == 3  # "long" and both children of "long2"
    finally:
        engine.shutdown()


def test_engine_core_process_startup_failure_and_death_are_reported(model_dir, tmp_path):
    from keel.engine.process_client import ProcessEngineCoreClient

    bad = EngineArgs(model=model_dir, profile="cpu", max_model_len=128, num_kv_blocks=2).create_engine_config()
    with pytest.raises(EngineDeadError, match="KVCacheSizeError"):  # the child's own error, named
        ProcessEngineCoreClient(bad)
    engine = AsyncLLM.from_engine_args(EngineArgs(model=model_dir, profile="cpu", max_model_len=128,
                                                  num_kv_blocks=64, engine_core_process=True))

    async def run():
        gen = engine.generate("Hello", SamplingParams(max_tokens=50, ignore_eos=True), "r")
        await anext(gen)
        engine.core_client._proc.kill()  # the core process dies mid-request
        with pytest.raises(EngineDeadError, match="died .killed by signal SIGKILL"):
            await asyncio.wait_for(_drain(gen), timeout=5)
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            await engine.check_health()
        assert not engine._collectors and not engine.output_processor.parents and not len(engine._request_stats)

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


async def _drain(gen) -> list:
    return [out async for out in gen]
