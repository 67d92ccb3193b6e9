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


def test_structured_outputs_through_the_triton_token_bitmask(tmp_path, monkeypatch):
    """The runner's grammar mask bound to kernels-triton's apply_token_bitmask (interpreted; also run once
    in the start-up profile, where it compiles on a GPU): under async scheduling every constrained output
    is valid and equals the one the torch reference mask gives."""
    pytest.importorskip("keel_structured_output_xgrammar")
    import re

    from keel_kernels_triton.token_bitmask import TritonApplyTokenBitmask

    from keel import LLM
    from keel.testing.tokenizer import build_tokenizer

    path = make_checkpoint("llama", tmp_path / "llama", vocab_size=512, **ODD)
    build_tokenizer(path, vocab_size=512)
    regex = r"(cat|dog)-[0-9]{2,4}"
    params = [SamplingParams(temperature=t, seed=3, max_tokens=40, structured_outputs={"regex": regex})
              for t in (0.0, 1.0)]
    prompts = ["Hello", "Numbers: 0 1 2"]
    kw = {"model": str(path), "dtype": "float32", "max_model_len": 64, "async_scheduling": True, "seed": 0,
          "plugins": ["platform-cpu", "attention-torch", "models-llama", "kernels-triton", "structured-output-xgrammar"]}
    reference = LLM(**kw)
    want = [o.outputs[0].text for o in reference.generate(prompts, params, use_tqdm=False)]
    reference.llm_engine.shutdown()
    monkeypatch.setattr(CpuPlatform, "use_custom_ops", lambda self: True)
    llm = LLM(**kw)
    try:
        assert isinstance(llm.llm_engine.core.worker.runner.token_bitmask.bound_ops["apply_token_bitmask"],
                          TritonApplyTokenBitmask)
        got = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
        runner, calls = llm.llm_engine.core.worker.runner, []
        op = runner.token_bitmask.bound_ops["apply_token_bitmask"]
        runner.token_bitmask.bound_ops = {"apply_token_bitmask": lambda *a: calls.append(a) or op(*a)}
        runner.profile_run(4, 2, 64)  # the start-up profile / warm-up launches it once
        assert len(calls) == 1
    finally:
        llm.llm_engine.shutdown()
    assert got == want
    assert all(re.fullmatch(regex, text) for text in got), got
