"""Test-only helpers: tiny checkpoints with clear greedy margins, engines, prompts."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.checkpoints import make_checkpoint
from keel.testing.fidelity import assert_close_to_hf, run_requests

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
# Transformers' top-2 logit margin above which the engine's greedy token must equal transformers'.
MIN_MARGIN = 0.5


def sharpen(path: Path, factor: float = 6.0) -> Path:
    """Scale the checkpoint's lm_head so greedy choices have clear margins (random tiny models are flat:
    300 logits of unit scale put the top two ~0.3 apart), then more steps test the token rule."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * factor
    save_file(tensors, str(file), metadata={"format": "pt"})
    return path


def float_llama(path: Path, **overrides: Any) -> Path:
    return sharpen(make_checkpoint("llama", path, **overrides))


def make_engine(path: Path, **kw: Any) -> LLMEngine:
    args = {"model": str(path), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 4,
            "max_model_len": 128, "seed": 0, **kw}
    return LLMEngine.from_engine_args(EngineArgs(**args))


def prompts_for(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def reference_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 x @ w.T (+ bias), the reference the kernels and methods are checked against."""
    out = x.double() @ w.double().T
    return out if bias is None else out + bias.double()


def check_layout(quantized: Path, reference: Path, tolerance: tuple[float, float], **engine_kw: Any
                 ) -> dict[str, float]:
    """The quantized checkpoint against transformers on its dequantized twin: plainly, then through chunked
    prefill, preemption and prefix-cache hits. `tolerance`: (logprob atol, top-2 margin); `engine_kw` go to
    both engines."""
    atol, margin = tolerance
    prompts = prompts_for(11, [5, 17, 9, 30])
    plain = run_requests(make_engine(quantized, **engine_kw), prompts, GREEDY)
    stats = assert_close_to_hf(reference, prompts, plain, atol=atol, min_margin=margin)
    assert stats["near_ties"] < len(prompts) * 4  # most steps have a clear margin: the token rule is tested

    shared = prompts_for(12, [16])[0]
    stressed_prompts = [shared + p for p in prompts_for(13, [3, 7, 2, 9])]
    engine = make_engine(quantized, max_num_batched_tokens=8, num_kv_blocks=14, max_model_len=40, **engine_kw)
    stressed = run_requests(engine, stressed_prompts, GREEDY, stagger=2)
    metrics = engine.get_metrics()
    assert metrics["num_preemptions_total"] > 0 and metrics["prefix_cache_hits_total"] > 0
    assert_close_to_hf(reference, stressed_prompts, stressed, atol=atol, min_margin=margin)
    return stats
