"""A fidelity scenario for parallel layouts: one engine run that exercises chunked prefill, preemption and
prefix-cache hits together, compared with transformers (tokens equal, logprobs within tolerance) and with
the same run on one rank. Model plugins use it for their TP / EP / PP layouts on tiny checkpoints."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
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
    and (with `reference`, the one-rank run) the very same tokens with logprobs within `atol`."""
    assert metrics["num_preemptions_total"] > 0, "the scenario did not preempt"
    assert metrics["prefix_cache_hits_total"] >= 16, "the scenario had no prefix hit"
    assert_matches_hf(path, prompts[:5], results, MAX_TOKENS, atol=atol)
    assert_matches_hf(path, prompts[5:], results, MAX_TOKENS, atol=atol, prefix="hit")
    if reference is not None:
        assert_same_as_reference(results, reference, atol)


def assert_same_as_reference(results: dict[str, Any], reference: dict[str, Any], atol: float = 1e-4) -> None:
    """Every request of `reference` (the one-rank run) has the same tokens in `results`, logprobs within `atol`."""
    assert set(results) == set(reference)
    for rid, out in results.items():
        got, ref = out.outputs[0], reference[rid].outputs[0]
        assert list(got.token_ids) == list(ref.token_ids), f"{rid}: tokens differ from the one-rank run"
        worst = max(abs(a[t].logprob - b[t].logprob) for a, b, t in zip(got.logprobs, ref.logprobs, got.token_ids))
        assert worst < atol, f"{rid}: logprob differs from the one-rank run by {worst:.2e}"


@contextlib.contextmanager
def local_ray_cluster(temp_dir: Any, num_cpus: int = 2) -> Iterator[None]:
    """A Ray cluster of `num_cpus` CPU bundles on loopback for the "ray" executor's tests (one per test
    module: starting one takes seconds); shut down on exit."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             _temp_dir=str(temp_dir))
    try:
        yield
    finally:
        ray.shutdown()
