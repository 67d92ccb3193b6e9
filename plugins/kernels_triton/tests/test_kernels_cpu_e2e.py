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

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_custom_ops.py covers CUDA")

ODD = {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16,
       "intermediate_size": 80, "num_hidden_layers": 2}


def _hf_greedy(path, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids, toks, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            tok = int(logits.argmax())
            toks.append(tok)
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            ids.append(tok)
    return toks, lps


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
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0]
    for i, p in enumerate(prompts):
        tokens, logprobs = _hf_greedy(path, p, 4)
        got = results[f"r{i}"]
        assert list(got.token_ids) == tokens
        ours = [next(iter(d.values())).logprob for d in got.logprobs]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=1e-4, rtol=0)
