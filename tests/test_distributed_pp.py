"""Pipeline parallelism on the CPU ("mp" executor, gloo): a 3-layer Llama with tied embeddings split over
2 stages (1 + 2 layers; the LM head shares the last stage's copy of the embedding), fed two micro-batches
at a time, gives transformers' greedy tokens and logprobs within 1e-4 through chunked prefill,
preemption and prefix hits; so does
TP=2 x PP=2 on 4 ranks (and equals the one-rank run)."""

from __future__ import annotations

import pytest

from keel.config import ConfigError, EngineArgs
from keel.distributed.pipeline import get_pp_indices
from keel.engine.llm_engine import LLMEngine
from keel.testing.checkpoints import make_checkpoint
from keel.testing.distributed import STRESS_ARGS, check_stress, run_stress, run_stress_engine, stress_prompts


def test_stage_layer_split():
    assert [get_pp_indices(3, r, 2) for r in range(2)] == [(0, 1), (1, 3)]
    assert [get_pp_indices(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="cannot fill"):
        get_pp_indices(1, 0, 2)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("pp") / "llama", num_hidden_layers=3,
                           tie_word_embeddings=True)


def test_pipeline_parallel_micro_batches_match_transformers(llama):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(llama), pipeline_parallel_size=2, **STRESS_ARGS))
    core = engine.core
    assert core.max_in_flight == 2 and core.scheduler.pipelined  # on by default, the CPU too
    overlapped, launch = [], core.executor.execute_model_async

    def spy(so):  # the requests of this step and of the non-empty steps still in flight
        busy = [set(s.num_scheduled_tokens) for s, _ in core._in_flight if not s.is_empty]
        if not so.is_empty and busy:
            overlapped.append((set(so.num_scheduled_tokens), busy))
        return launch(so)

    core.executor.execute_model_async = spy
    try:
        prompts = stress_prompts(300)
        results, metrics = run_stress(engine, prompts)
    finally:
        engine.shutdown()
    check_stress(llama, prompts, results, metrics)
    # Both stages had work: a micro-batch went in while another was in flight (decodes never in two).
    assert len(overlapped) >= 10, overlapped


def test_tensor_and_pipeline_parallel_match_transformers_and_one_rank(llama):
    # 4 ranks: stage 0 is ranks 0-1 (a TP pair), stage 1 ranks 2-3; each TP rank sends to its peer.
    one_rank = run_stress_engine(llama, 300)
    run = run_stress_engine(llama, 300, tensor_parallel_size=2, pipeline_parallel_size=2)
    check_stress(llama, run.prompts, run.results, run.metrics, reference=one_rank.results)


def test_pipeline_parallel_needs_a_multi_rank_executor():
    with pytest.raises(ConfigError, match="'uni' runs one worker"):
        EngineArgs(platform="cpu", pipeline_parallel_size=2, distributed_executor_backend="uni").create_engine_config(
            require_model=False)
