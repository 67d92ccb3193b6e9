"""End to end on the CPU platform with attention_backend="triton_flash" (kernels interpreted): greedy
tokens and logprobs of a tiny random Llama equal transformers' (float32). Kept tiny: the interpreter
runs every Triton program in Python."""

from __future__ import annotations

import pytest
import torch

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.checkpoints import make_checkpoint
from keel.testing.fidelity import assert_matches_hf, run_requests

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA runs cover this compiled")


def test_triton_flash_engine_matches_transformers(tmp_path):
    path = make_checkpoint("llama", tmp_path / "llama", head_dim=64, num_hidden_layers=1)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(path), skip_tokenizer_init=True, dtype="float32", block_size=16, max_model_len=64,
        plugins=["platform-cpu", "attention-flash", "models-llama"], attention_backend="triton_flash",
        max_num_batched_tokens=24,  # the 19-token prompt is prefilled in two chunks next to a decode
    ))
    assert {layer.backend.name for layer in engine.core.worker.runner.attn_layers} == {"triton_flash"}
    prompts = [[5, 17, 42, 7, 99], list(range(3, 22))]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True)
    results = run_requests(engine, prompts, params)
    assert_matches_hf(path, prompts, results, 4, atol=1e-4)
