"""End to end on the CPU platform with custom ops forced on (kernels interpreted): every RMSNorm, rope and
SiluAndMul of a tiny random Llama / Qwen3 runs the Triton kernels, and greedy tokens and logprobs equal
transformers' (float32). Odd sizes everywhere (hidden 48, 3 heads, intermediate 80); chunked prefill next
to decodes."""

from __future__ import annotations

import pytest
import torch
from keel_kernels_triton.ops import TritonFusedAddRMSNorm, TritonRotaryEmbedding, TritonSiluAndMul
from keel_platform_cpu.platform import CpuPlatform

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.checkpoints import make_checkpoint
from keel.testing.fidelity import assert_matches_hf, run_requests

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_custom_ops.py covers CUDA")

ODD = {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16,
       "intermediate_size": 80, "num_hidden_layers": 2}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_with_triton_custom_ops_matches_transformers(arch, tmp_path, monkeypatch):
    monkeypatch.setattr(CpuPlatform, "use_custom_ops", lambda self: True)
    path = make_checkpoint(arch, tmp_path / arch, **ODD)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(path), skip_tokenizer_init=True, dtype="float32", block_size=16, max_model_len=64,
        plugins=["platform-cpu", "attention-torch", "models-llama", "kernels-triton"],
        attention_backend="torch_paged",
        max_num_batched_tokens=24,  # the 19-token prompt is prefilled in two chunks next to a decode
    ))
    layer = engine.core.worker.runner.model.model.layers[0]
    assert isinstance(layer.input_layernorm.bound_ops["fused_add_rms_norm"], TritonFusedAddRMSNorm)
    assert isinstance(layer.self_attn.rotary_emb.bound_ops["rotary_embedding"], TritonRotaryEmbedding)
    assert isinstance(layer.mlp.act_fn.bound_ops["silu_and_mul"], TritonSiluAndMul)
    if arch == "qwen3":  # per-head q/k norms on strided views of the qkv output
        assert "rms_norm" in layer.self_attn.q_norm.bound_ops
    prompts = [[5, 17, 42, 7, 99], list(range(3, 22))]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True)
    results = run_requests(engine, prompts, params)
    assert_matches_hf(path, prompts, results, 4, atol=1e-4)
