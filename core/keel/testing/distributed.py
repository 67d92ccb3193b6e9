"""A fidelity scenario for parallel layouts: one engine run that exercises chunked prefill, preemption and
prefix-cache hits together, compared with transformers (tokens equal, logprobs within tolerance) and with
the same run on one rank. Model plugins use it for their TP / EP / PP layouts on tiny checkpoints."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from keel.testing.fidelity import assert_matches_hf, run_requests

# A prompt budget of 16 tokens chunks the long prompts; 24 blocks of 4 tokens cannot hold every request
# at once (preemption); the last two prompts extend the first's 16-token prefix (prefix hits).
STRESS_ARGS: dict[str, Any] = {
    "skip_tokenizer_init": True, "dtype": "float32", "block_size": 4, "max_model_len": 64, "seed": 0,
    "max_num_batched_tokens": 16, "num_kv_blocks": 24,
}
MAX_TOKENS = 10


def stress_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (23, 5, 17, 9, 12)]
    return prompts + [prompts[0][:16] + [4, 5, 6], prompts[0][:16] + [7, 8]]


def run_stress(engine: Any, prompts: list[list[int]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(results by request id, the engine's metrics afterwards): prompts arrive one every step."""
    from keel.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    results = run_requests(engine, prompts[:5], params, stagger=1)
    results |= run_requests(engine, prompts[5:], params, prefix="hit")
    return results, engine.get_metrics()


@dataclass(frozen=True)
class StressRun:
    prompts: list[list[int]]
    results: dict[str, Any]  # request id -> final RequestOutput
    metrics: dict[str, Any]  # the engine's metrics afterwards
    executor_backend: str


def run_stress_engine(model: Any, vocab_size: int, **engine_args: Any) -> StressRun:
    """Start an `LLMEngine` on `model` with STRESS_ARGS and `engine_args`, run the scenario, shut it down."""
    from keel.config import EngineArgs
    from keel.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model), **{**STRESS_ARGS, **engine_args}))
    try:
        prompts = stress_prompts(vocab_size)
        results, metrics = run_stress(engine, prompts)
    finally:
        engine.shutdown()
    return StressRun(prompts, results, metrics, engine.config.parallel.executor_backend)


def check_stress(path: Any, prompts: list[list[int]], results: dict[str, Any], metrics: dict[str, Any],
                 reference: dict[str, Any] | None = None, atol: float = 1e-4) -> None:
    """Tokens equal transformers' greedy ones, logprobs within `atol`, the stress actually happened,
    and (with `reference`, the one-rank run) the very same tokens."""
    assert metrics["num_preemptions_total"] > 0, "the scenario did not preempt"
    assert metrics["prefix_cache_hits_total"] >= 16, "the scenario had no prefix hit"
    assert_matches_hf(path, prompts[:5], results, MAX_TOKENS, atol=atol)
    assert_matches_hf(path, prompts[5:], results, MAX_TOKENS, atol=atol, prefix="hit")
    if reference is not None:
        for rid, out in results.items():
            assert list(out.outputs[0].token_ids) == list(reference[rid].outputs[0].token_ids), rid
