"""DeepSeek under tensor, expert and data parallelism on the CPU ("mp" executor, gloo): MLA heads split
over TP=2 and TP=4 with the routed experts split (V2) or sharded over EP=2 / EP=4 (V3), and attention DP=2
with the experts EP over the same ranks; greedy tokens equal transformers' and the one-rank run's,
float32 logprobs within 1e-4 of both, through chunked prefill, preemption and prefix hits."""

from __future__ import annotations

import pytest
from deepseek_test_utils import DEEPSEEK_YARN, VOCAB, make_deepseek_checkpoint

from keel.testing.distributed import check_stress, run_stress_engine

CHECKPOINTS = {
    "v2": (2, {}),
    "v3": (3, {"q_lora_rank": 48, "rope_parameters": DEEPSEEK_YARN, "routed_scaling_factor": 2.5}),
}
# The tiny config has 4 MLA heads and 8 routed experts: TP=4 leaves one head and two experts per rank.
CASES = {
    "v2-tp2": ("v2", {"tensor_parallel_size": 2}),
    "v2-tp4": ("v2", {"tensor_parallel_size": 4}),
    "v3-tp2-ep2": ("v3", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    "v3-tp4-ep4": ("v3", {"tensor_parallel_size": 4, "enable_expert_parallel": True}),
    # Attention DP, experts EP over the same 2 ranks: each replica its own scheduler and 14-block cache
    # (it still preempts; the prefix-hit prompts go to replica 0, idle then, which holds their prefix).
    "v3-dp2-ep2": ("v3", {"data_parallel_size": 2, "enable_expert_parallel": True, "max_model_len": 48,
                          "num_kv_blocks": 14}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek-parallel")
    return {name: make_deepseek_checkpoint(v, root / name, **kw) for name, (v, kw) in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def one_rank(checkpoints):
    return {name: run_stress_engine(path, VOCAB) for name, path in checkpoints.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_parallel_matches_transformers_and_one_rank(checkpoints, one_rank, case):
    name, parallel = CASES[case]
    run = run_stress_engine(checkpoints[name], VOCAB, **parallel)
    assert run.executor_backend == "mp"
    check_stress(checkpoints[name], run.prompts, run.results, run.metrics, reference=one_rank[name].results)


def test_deepseek_tp_ep_on_ray_matches_transformers_and_one_rank(tmp_path_factory, checkpoints, one_rank):
    pytest.importorskip("ray")
    from keel.testing.distributed import local_ray_cluster

    with local_ray_cluster(tmp_path_factory.mktemp("ray")):
        run = run_stress_engine(checkpoints["v3"], VOCAB, tensor_parallel_size=2, enable_expert_parallel=True,
                                distributed_executor_backend="ray")
    assert run.executor_backend == "ray"
    check_stress(checkpoints["v3"], run.prompts, run.results, run.metrics, reference=one_rank["v3"].results)
