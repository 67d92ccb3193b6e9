"""The "ray" executor on a local Ray cluster the test starts on loopback: TP=2 and PP=2 Llama equal
transformers (and PP=2 the one-rank run) through chunked prefill, preemption and prefix hits; a killed
actor fails the engine naming its rank. DeepSeek TP + EP on Ray: the models_deepseek plugin's tests."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from keel.config import ConfigError, EngineArgs  # noqa: E402
from keel.distributed.executor import WorkerDiedError  # noqa: E402
from keel.engine.llm_engine import LLMEngine  # noqa: E402
from keel.testing.checkpoints import make_checkpoint  # noqa: E402
from keel.testing.distributed import (  # noqa: E402
    STRESS_ARGS,
    check_stress,
    local_ray_cluster,
    run_stress,
    run_stress_engine,
    stress_prompts,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with local_ray_cluster(tmp_path_factory.mktemp("ray")):
        yield


def test_ray_tensor_parallel_matches_transformers_and_survives_nothing(cluster, tmp_path):
    path = make_checkpoint("llama", tmp_path / "llama")
    args = EngineArgs(model=str(path), tensor_parallel_size=2, distributed_executor_backend="ray", **STRESS_ARGS)
    engine = LLMEngine.from_engine_args(args)
    try:
        prompts = stress_prompts(300)
        results, metrics = run_stress(engine, prompts)
        check_stress(path, prompts, results, metrics)
        # A killed actor ends the engine with an error naming its rank, not a hang.
        from keel import SamplingParams

        engine.add_request("k", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=40, ignore_eos=True))
        engine.step()
        ray.kill(engine.core.executor.actors[1])
        with pytest.raises(WorkerDiedError, match="worker rank 1") as info:
            while engine.has_unfinished_requests():
                engine.step()
        assert info.value.rank == 1
    finally:
        engine.shutdown()


def test_a_cluster_too_small_is_a_startup_error(cluster, tmp_path):
    path = make_checkpoint("llama", tmp_path / "llama")
    args = EngineArgs(model=str(path), tensor_parallel_size=4, distributed_executor_backend="ray", **STRESS_ARGS)
    with pytest.raises(ConfigError, match="4 ranks, but the Ray cluster has 2 CPU"):
        LLMEngine.from_engine_args(args)


def test_ray_pipeline_parallel_matches_transformers_and_one_rank(cluster, tmp_path):
    # 3 layers over 2 stages (1 + 2), tied embeddings: the last stage holds its own copy for the LM head.
    path = make_checkpoint("llama", tmp_path / "llama", num_hidden_layers=3, tie_word_embeddings=True)
    one_rank = run_stress_engine(path, 300)
    run = run_stress_engine(path, 300, pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert run.executor_backend == "ray"
    check_stress(path, run.prompts, run.results, run.metrics, reference=one_rank.results)
