"""DeepSeek-V2/V3 on the GPU under KV-cache pressure (skipped without one).

Six requests share a cache of 16 blocks of 4 tokens, about a third of what they need together, so the
scheduler preempts running requests (freed, recomputed from scratch when resumed, possibly from
prefix-cache hits). Through all of that, in float32 with the `cuda` profile (triton_mla, fused MoE,
kernels-triton custom ops), greedy tokens must equal transformers' full-recompute greedy loop on the same
GPU and logprobs must agree within 1e-4 -- with decode steps replayed from CUDA graphs and eagerly.
The CPU counterpart is plugins/models_deepseek/tests/test_deepseek_engine.py::test_preemption_keeps_outputs.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_cuda_mla import _make_tiny_deepseek

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.fidelity import assert_matches_hf, run_requests

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
PROMPT_LENS = (10, 14, 9, 12, 11, 13)
# 16 blocks x 4 tokens hold ~64 tokens; the six requests grow to ~140. max_model_len 48 keeps one request
# (12 blocks + the null block) within the cache, as the worker requires.
TIGHT_CACHE = {"block_size": 4, "num_kv_blocks": 16, "max_model_len": 48, "max_num_seqs": 8}
CUDA = {"profile": "cuda", "platform": "cuda", "attention_backend": "auto"}


@pytest.fixture(scope="module", params=[2, 3], ids=["v2", "v3"])
def deepseek_ckpt(tmp_path_factory, request):
    return _make_tiny_deepseek(tmp_path_factory.mktemp("cuda_preempt") / f"dsv{request.param}", request.param)


def run_preempted(path, hf_device: str, **engine_kw) -> LLMEngine:
    """Serve PROMPT_LENS-long prompts together from the tight cache; check that preemption happened and
    that every request still matches transformers on `hf_device`. Returns the engine for further checks."""
    args = {"model": str(path), "skip_tokenizer_init": True, "dtype": "float32", "seed": 0,
            **TIGHT_CACHE, **engine_kw}
    engine = LLMEngine.from_engine_args(EngineArgs(**args))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENS]
    results = run_requests(engine, prompts, GREEDY)
    assert engine.get_metrics()["num_preemptions_total"] > 0, "the cache was large enough: nothing preempted"
    assert_matches_hf(path, prompts, results, MAX_TOKENS, atol=1e-4, device=hf_device)
    return engine


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_preempted_deepseek_matches_transformers_on_cuda(deepseek_ckpt, eager):
    engine = run_preempted(deepseek_ckpt, "cuda", enforce_eager=eager, **CUDA)
    runner = engine.core.worker.runner
    assert {layer.backend.name for layer in runner.attn_layers} == {"triton_mla"}
    if eager:
        assert runner.cuda_graphs is None
    else:  # the resumed requests' decode steps ran from the graphs, not only the first ones
        assert runner.cuda_graphs is not None and runner.cuda_graphs.num_replays > 0
    engine.shutdown()
