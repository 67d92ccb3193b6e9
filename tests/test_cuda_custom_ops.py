"""kernels-triton compiled on a GPU (skipped without one): the fused ops against keel's torch layers at
Llama-3-8B layer shapes and odd ones, and the engine with the ops bound (profile-style plugin set) against
transformers -- float32 greedy tokens (graph replay and eager) and bf16 logprobs."""

from __future__ import annotations

import random

import pytest
import torch

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.layers.activation import SiluAndMul
from keel.layers.layernorm import RMSNorm
from keel.layers.rotary import RotaryEmbedding
from keel.testing.checkpoints import make_checkpoint

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
PLUGINS = ["platform-cuda", "attention-flash", "models-llama", "kernels-triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (1e-3, 1e-3)}


def _ops():
    from keel_kernels_triton import ops

    return ops


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape and torch.isfinite(got).all()
    rtol, atol = TOL[want.dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def _poison(numel: int, dtype: torch.dtype) -> None:
    junk = torch.full((numel * 4,), float("nan"), dtype=dtype, device="cuda")
    del junk


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 4096), (37, 4096), (3, 5000), (2, 12000)])
def test_norms_match_torch(dtype, rows, hidden):
    gen = torch.Generator(device="cuda").manual_seed(rows + hidden)
    norm = RMSNorm(hidden, 1e-5).to("cuda", dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen, device="cuda") + 0.5)
    x = torch.randn(rows, hidden, generator=gen, device="cuda").to(dtype) * 3
    res = torch.randn(rows, hidden, generator=gen, device="cuda").to(dtype)
    want_out, want_res = norm(x, res)
    want_plain = norm(x)
    _poison(rows * hidden, dtype)
    out, new_res = _ops().TritonFusedAddRMSNorm()(x, res, norm.weight, 1e-5)
    _close(new_res, want_res)
    _close(out, want_out)
    _close(_ops().TritonRMSNorm()(x, norm.weight, 1e-5), want_plain)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 14336), (64, 14336), (5, 333)])
def test_silu_and_mul_matches_torch(dtype, rows, d):
    x = torch.randn(rows, 2 * d, device="cuda").to(dtype) * 4
    want = SiluAndMul()(x)
    _poison(rows * d, dtype)
    _close(_ops().TritonSiluAndMul()(x), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,nq,nk,head,rot", [(1, 32, 8, 128, 128), (300, 32, 8, 128, 128), (9, 12, 4, 96, 48)])
def test_rotary_matches_torch(dtype, n, nq, nk, head, rot):
    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    with torch.device("cuda"):
        rope = RotaryEmbedding(head, rot, 8192, params)
    qkv = torch.randn(n, (nq + 2 * nk) * head, device="cuda").to(dtype)
    q, k = qkv[:, : nq * head], qkv[:, nq * head : (nq + nk) * head]
    positions = torch.randint(0, 8192, (n,), device="cuda")
    want_q, want_k = rope(positions, q, k)
    _poison(qkv.numel(), dtype)
    got_q, got_k = _ops().TritonRotaryEmbedding()(positions, q, k, rope.cos_cache, rope.sin_cache, head, rot)
    _close(got_q, want_q)
    _close(got_k, want_k)


# --- engine ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("cuda_ops") / "llama", head_dim=64,
                           num_hidden_layers=3, vocab_size=512, max_position_embeddings=512, hidden_size=192,
                           num_attention_heads=3, num_key_value_heads=1, intermediate_size=336)


def _engine(path, **kw) -> LLMEngine:
    args = {"model": str(path), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 16,
            "max_model_len": 256, "plugins": PLUGINS, "platform": "cuda", "attention_backend": "triton_flash",
            "max_num_seqs": 16, "gpu_memory_utilization": 0.3}
    args.update(kw)
    engine = LLMEngine.from_engine_args(EngineArgs(**args))
    layer = engine.core.worker.runner.model.model.layers[0]
    assert {"fused_add_rms_norm", "rms_norm"} <= set(layer.input_layernorm.bound_ops)
    assert "rotary_embedding" in layer.self_attn.rotary_emb.bound_ops
    assert "silu_and_mul" in layer.mlp.act_fn.bound_ops
    return engine


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _generate(engine: LLMEngine, prompts, n: int):
    params = SamplingParams(temperature=0, max_tokens=n, logprobs=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[f"r{i}"] for i in range(len(prompts))]


def _hf(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").cuda().eval()


@torch.no_grad()
def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt], device="cuda")
    for _ in range(n):
        ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


@torch.no_grad()
def _hf_logprobs(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens], device="cuda")
    lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    rows = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1, device="cuda")
    return lp[rows, torch.tensor(tokens, device="cuda")].double().cpu()


@pytest.mark.parametrize("eager", [False, True])
def test_fp32_greedy_with_custom_ops_equals_transformers(ckpt, eager):
    engine = _engine(ckpt, enforce_eager=eager)
    runner = engine.core.worker.runner
    prompts = _prompts(1, [5, 37, 1, 130, 64, 9])
    outs = _generate(engine, prompts, 12)
    if not eager:
        assert runner.cuda_graphs.num_replays > 0
    hf = _hf(ckpt, torch.float32)
    for p, out in zip(prompts, outs):
        assert list(out.token_ids) == _hf_greedy(hf, p, 12)


def test_bf16_logprobs_with_custom_ops_within_tolerance(ckpt):
    outs = _generate(_engine(ckpt, dtype="bfloat16"), prompts := _prompts(2, [40, 7, 90]), 16)
    hf32, hf16 = _hf(ckpt, torch.float32), _hf(ckpt, torch.bfloat16)
    worst_keel = worst_hf = 0.0
    for p, out in zip(prompts, outs):
        toks = list(out.token_ids)
        ours = torch.tensor([next(iter(d.values())).logprob for d in out.logprobs], dtype=torch.float64)
        truth = _hf_logprobs(hf32, p, toks)
        worst_keel = max(worst_keel, float((ours - truth).abs().max()))
        worst_hf = max(worst_hf, float((_hf_logprobs(hf16, p, toks) - truth).abs().max()))
    print(f"bf16 logprob error vs float32 with custom ops: keel {worst_keel:.4f}, transformers {worst_hf:.4f}")
    assert worst_keel <= 2 * worst_hf + 0.02
