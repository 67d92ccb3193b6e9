"""DeepSeek under tensor and expert parallelism on the CPU ("mp" executor, gloo): MLA heads split over
TP=2 with the routed experts split (V2) or sharded over EP=2 (V3); greedy tokens equal transformers',
float32 logprobs within 1e-4, through chunked prefill, preemption and prefix hits."""

from __future__ import annotations

import pytest
from deepseek_test_utils import DEEPSEEK_YARN, VOCAB, make_deepseek_checkpoint

from keel.testing.distributed import check_stress, run_stress_engine

CASES = {
    "v2-tp2": (2, {}, {}),
    "v3-tp2-ep2": (3, {"q_lora_rank": 48, "rope_parameters": DEEPSEEK_YARN, "routed_scaling_factor": 2.5},
                   {"enable_expert_parallel": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_parallel_matches_transformers(tmp_path, case):
    version, overrides, parallel = CASES[case]
    path = make_deepseek_checkpoint(version, tmp_path / case, **overrides)
    run = run_stress_engine(path, VOCAB, tensor_parallel_size=2, **parallel)
    check_stress(path, run.prompts, run.results, run.metrics)
