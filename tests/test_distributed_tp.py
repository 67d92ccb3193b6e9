"""Tensor parallelism on the CPU (gloo), with the "mp" executor: TP=2 and TP=4 Llama runs equal the
one-rank run and transformers through chunked prefill, preemption and prefix hits; a killed worker
fails the engine naming its rank."""

from __future__ import annotations

import os
import signal
import time

import pytest

from keel.config import EngineArgs
from keel.distributed.executor import WorkerDiedError
from keel.engine.llm_engine import LLMEngine
from keel.testing.checkpoints import make_checkpoint
from keel.testing.distributed import STRESS_ARGS, check_stress, run_stress_engine



@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # 4 query heads, 2 KV heads: TP=2 splits the KV heads, TP=4 replicates each on two ranks.
    return make_checkpoint("llama", tmp_path_factory.mktemp("tp") / "llama")


@pytest.fixture(scope="module")
def one_rank(llama):
    return run_stress_engine(llama, 300)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_one_rank_and_transformers(llama, one_rank, tp):
    run = run_stress_engine(llama, 300, tensor_parallel_size=tp)
    assert run.executor_backend == "mp"
    check_stress(llama, run.prompts, run.results, run.metrics, reference=one_rank.results)
    assert run.metrics["num_preemptions_total"] == one_rank.metrics["num_preemptions_total"]


def test_killed_worker_fails_the_engine_naming_its_rank(llama):
    from keel import SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(llama), tensor_parallel_size=2, **STRESS_ARGS))
    executor = engine.core.executor
    try:
        assert [i["tp_all_reduce"] for i in executor.collective_rpc("distributed_info")] == [2.0, 2.0]
        engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(executor.worker_pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL") as info:
            while engine.has_unfinished_requests():
                engine.step()
        assert info.value.rank == 1
        assert time.monotonic() - start < 30
        assert all(code is not None for code in executor.worker_exit_codes())  # rank 0 is gone too
        with pytest.raises(WorkerDiedError):  # and the engine stays dead
            engine.step() if engine.has_unfinished_requests() else executor.check_health()
    finally:
        engine.shutdown()


def test_mp_executor_with_one_rank_joins_through_the_communicator(llama, one_rank):
    # The world of one still meets at a rendezvous and uses the platform's communicator (on CUDA: NCCL,
    # tests/test_cuda_distributed.py), and gives the one-rank run's tokens and logprobs.
    from keel.testing.distributed import assert_same_as_reference, run_stress

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(llama), distributed_executor_backend="mp",
                                                   **STRESS_ARGS))
    try:
        info = engine.core.executor.collective_rpc("distributed_info")
        assert [(i["backend"], i["tp_all_reduce"]) for i in info] == [("gloo", 1.0)]
        results, _ = run_stress(engine, one_rank.prompts)
    finally:
        engine.shutdown()
    assert_same_as_reference(results, one_rank.results)
