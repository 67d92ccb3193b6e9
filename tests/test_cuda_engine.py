"""keel on a GPU against transformers on the same GPU (skipped without one).

Fidelity: float32 greedy tokens equal transformers' (decode steps replayed from CUDA graphs, and
eagerly). bf16: keel's logprob of every token it generated is compared with transformers' float32
log-softmax of the same sequence; the allowed error is twice what transformers itself makes in bf16
on the same inputs, plus 0.02 -- bf16 keeps 8 mantissa bits (relative rounding 2^-9 ~ 2e-3 per
operation), so both implementations land an O(1e-2) distance from the float32 truth, but a wrong
kernel lands O(1) away.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.checkpoints import make_checkpoint

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
PLUGINS = ["platform-cuda", "attention-flash", "models-llama"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("cuda") / "llama", head_dim=64, num_hidden_layers=3,
                           vocab_size=512, max_position_embeddings=512)


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _engine(path, **kw) -> LLMEngine:
    args = {"model": str(path), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 16,
            "max_model_len": 256, "plugins": PLUGINS, "platform": "cuda", "attention_backend": "triton_flash",
            "max_num_seqs": 16, "gpu_memory_utilization": 0.3}
    args.update(kw)
    return LLMEngine.from_engine_args(EngineArgs(**args))


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
        nxt = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


@torch.no_grad()
def _hf_logprobs(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens], device="cuda")
    lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    rows = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1, device="cuda")
    return lp[rows, torch.tensor(tokens, device="cuda")].double().cpu()


@pytest.mark.parametrize("eager", [False, True])
def test_fp32_greedy_equals_transformers(ckpt, eager):
    engine = _engine(ckpt, enforce_eager=eager)
    runner = engine.core.worker.runner
    assert (runner.cuda_graphs is None) == eager
    prompts = _prompts(1, [5, 37, 1, 130, 64, 9])
    outs = _generate(engine, prompts, 12)
    if not eager:
        assert runner.cuda_graphs.num_replays > 0
    hf = _hf(ckpt, torch.float32)
    for p, out in zip(prompts, outs):
        assert list(out.token_ids) == _hf_greedy(hf, p, 12)


def test_bf16_logprobs_within_tolerance(ckpt):
    engine = _engine(ckpt, dtype="bfloat16")
    prompts = _prompts(2, [40, 7, 90])
    outs = _generate(engine, prompts, 16)
    hf32, hf16 = _hf(ckpt, torch.float32), _hf(ckpt, torch.bfloat16)
    worst_keel = worst_hf = 0.0
    for p, out in zip(prompts, outs):
        toks = list(out.token_ids)
        ours = torch.tensor([next(iter(d.values())).logprob for d in out.logprobs], dtype=torch.float64)
        truth = _hf_logprobs(hf32, p, toks)
        worst_keel = max(worst_keel, float((ours - truth).abs().max()))
        worst_hf = max(worst_hf, float((_hf_logprobs(hf16, p, toks) - truth).abs().max()))
    print(f"bf16 logprob error vs float32: keel {worst_keel:.4f}, transformers {worst_hf:.4f}")
    assert worst_keel <= 2 * worst_hf + 0.02


def test_dummy_weights_and_memory_profile(ckpt, caplog):
    caplog.set_level("INFO", logger="keel.worker")
    engine = _engine(ckpt, dtype="bfloat16", load_format="dummy", gpu_memory_utilization=0.2)
    worker = engine.core.worker
    assert worker._profile_activation_bytes() > 0
    per_block = worker.runner.kv_cache_bytes_per_block()
    total = torch.cuda.mem_get_info()[1]
    assert 0 < (worker.num_blocks - 1) * per_block <= 0.2 * total
    assert any("KV cache budget" in r.message for r in caplog.records)
    outs = _generate(engine, _prompts(3, [20, 3]), 4)
    assert all(len(o.token_ids) == 4 for o in outs)


@pytest.mark.parametrize("kind", ["latency", "throughput"])
def test_keel_bench_runs_on_the_gpu(ckpt, kind):
    extra = ["--batch-size", "2", "--num-iters", "1"] if kind == "latency" else ["--num-prompts", "8"]
    cmd = [sys.executable, "-m", "keel.cli", "bench", kind, "--profile", "cuda", "--model", str(ckpt),
           "--dtype", "bfloat16", "--max-model-len", "256", "--gpu-memory-utilization", "0.3",
           "--skip-tokenizer-init", "--input-len", "16", "--output-len", "8", "--json", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout[out.stdout.index("{"):])
    assert (result["time_per_output_token_ms"] if kind == "latency" else result["output_tokens_per_s"]) > 0


@pytest.mark.parametrize("engine_core_process", [False, True], ids=["core-thread", "core-process"])
def test_async_llm_on_cuda_matches_sync_scheduling_and_frees_kv(ckpt, engine_core_process):
    """The server's engine (AsyncLLM, async scheduling on by default on CUDA), with the core on a thread or
    in its own spawned process: the same greedy tokens as a synchronously scheduled engine, and a client
    that leaves early frees its blocks."""
    import asyncio

    from keel.engine.async_llm import AsyncLLM

    prompts = _prompts(5, [9, 30, 17])
    sync = _engine(ckpt, async_scheduling=False)
    expected = [o.token_ids for o in _generate(sync, prompts, 12)]
    sync.shutdown()
    del sync
    args = {"model": str(ckpt), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 16,
            "max_model_len": 256, "plugins": PLUGINS, "platform": "cuda", "attention_backend": "triton_flash",
            "max_num_seqs": 16, "gpu_memory_utilization": 0.3, "engine_core_process": engine_core_process}
    engine = AsyncLLM.from_engine_args(EngineArgs(**args))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def one(i, p):
        tokens = []
        async for out in engine.generate({"prompt_token_ids": p}, params, f"r{i}"):
            tokens += out.outputs[0].token_ids
        return tokens

    async def run():
        got = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        gen = engine.generate({"prompt_token_ids": prompts[0]},
                              SamplingParams(max_tokens=200, ignore_eos=True), "long")
        await anext(gen)
        await gen.aclose()
        for _ in range(500):
            m = engine.get_metrics()
            if m["kv_cache_usage"] == 0 and m["num_requests_running"] == 0:
                break
            await asyncio.sleep(0.01)
        return got

    try:
        assert asyncio.run(run()) == expected
        m = engine.get_metrics()
        assert m["kv_cache_usage"] == 0 and m["num_requests_running"] == 0
    finally:
        engine.shutdown()
