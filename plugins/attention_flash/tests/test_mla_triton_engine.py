"""End to end on the CPU platform with attention_backend="triton_mla" (kernels interpreted): greedy
tokens and logprobs of a tiny random DeepSeek-V2 equal transformers' (float32). A chunked prompt runs
next to a decode, so the step mixes the split-K decode and the prefill tiles. Kept tiny: the
interpreter runs every Triton program in Python."""

from __future__ import annotations

import math

import pytest
import torch

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA runs cover this compiled")

VOCAB = 128


@torch.no_grad()
def make_tiny_deepseek_v2(path):
    """A float32 random DeepSeek-V2 (MLA, one dense + one MoE layer) with O(1) weights, so logits are
    far from flat and a 1e-4 logprob comparison means something."""
    import transformers

    config = transformers.DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    model.save_pretrained(path)
    return path


def hf_greedy(path, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    ids, toks, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            tok = int(logits.argmax())
            toks.append(tok)
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            ids.append(tok)
    return toks, lps


def test_triton_mla_engine_matches_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = make_tiny_deepseek_v2(tmp_path / "dsv2")
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(path), skip_tokenizer_init=True, dtype="float32", block_size=4, max_model_len=64,
        plugins=["platform-cpu", "attention-flash", "models-deepseek"], attention_backend="triton_mla",
        max_num_batched_tokens=12,  # the 17-token prompt is prefilled in chunks next to a decode
    ))
    assert {layer.backend.name for layer in engine.core.worker.runner.attn_layers} == {"triton_mla"}
    prompts = [[5, 17, 42, 7, 99], list(range(3, 20))]
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0]
    for i, p in enumerate(prompts):
        tokens, logprobs = hf_greedy(path, p, 3)
        got = results[f"r{i}"]
        assert list(got.token_ids) == tokens
        ours = [next(iter(d.values())).logprob for d in got.logprobs]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("k_scale", [None, 0.02], ids=["unit-scale", "checkpoint-scale"])
def test_triton_mla_fp8_latent_cache_matches_the_torch_reference(tmp_path, monkeypatch, k_scale):
    """An fp8 latent cache: triton_mla's tokens and logprobs equal torch_mla's fp8 path (1e-4), with a unit
    scale and with per-layer `self_attn.k_scale` from the checkpoint; a chunked prompt next to a decode."""
    from safetensors.torch import load_file, save_file

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = make_tiny_deepseek_v2(tmp_path / "dsv2")
    if k_scale is not None:
        file = next(path.glob("*.safetensors"))
        w = load_file(str(file))
        for i in range(2):
            w[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_scale)
        save_file(w, str(file), metadata={"format": "pt"})

    def run(backend, plugin):
        engine = LLMEngine.from_engine_args(EngineArgs(
            model=str(path), skip_tokenizer_init=True, dtype="float32", block_size=4, max_model_len=64,
            plugins=["platform-cpu", plugin, "models-deepseek"], attention_backend=backend, kv_cache_dtype="fp8",
            max_num_batched_tokens=12,
        ))
        assert engine.core.worker.runner.kv_caches[0].dtype == torch.float8_e4m3fn
        from keel.testing.fidelity import run_requests

        params = SamplingParams(temperature=0, max_tokens=3, logprobs=0, ignore_eos=True)
        results = run_requests(engine, [[5, 17, 42, 7, 99], list(range(3, 20))], params)
        return {k: (list(o.outputs[0].token_ids), [d[t].logprob for d, t in zip(o.outputs[0].logprobs,
                                                                              o.outputs[0].token_ids)])
                for k, o in results.items()}

    got, want = run("triton_mla", "attention-flash"), run("torch_mla", "attention-torch")
    for key, (toks, lps) in want.items():
        assert got[key][0] == toks
        torch.testing.assert_close(torch.tensor(got[key][1]), torch.tensor(lps), atol=1e-4, rtol=0)
