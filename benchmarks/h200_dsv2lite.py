"""keel vs HuggingFace transformers on one GPU, DeepSeek-V2-Lite shape, random weights, bf16.

    python benchmarks/h200_dsv2lite.py [--out benchmarks/results/h200-dsv2lite.json] [--layers 27]
        [--num-prompts 256] [--hf-prompts 64] [--eager]
    python benchmarks/h200_dsv2lite.py --profile-only   # only item 7 (dummy weights), merged into --out

One run measures on the same device:
  1. the ceilings (copy bandwidth, bf16 matmul), as in h200_llama8b.py;
  2. transformers' DeepseekV2ForCausalLM built with random weights on the GPU; keel's engine (profile
     `cuda`, load_format="dummy") then loads those same tensors;
  3. keel batch-1 decode (128-token prompt, 128 output tokens) against the memory floor of the bytes a
     batch-1 step actually reads: attention + dense/shared MLPs + the 6 routed experts per MoE layer +
     norms + lm_head (not all 64 experts);
  4. keel offline throughput (num_prompts of 128 in / 128 out) and transformers generate() at batch 64;
  5. the fused MoE kernel against the per-expert loop (torch reference) at batch 1 and 64, one layer;
  6. if the `mtp` spec decoder is installed: the cost of a one-draft MTP step against a plain decode step;
  7. `step_profile`: where one batch-1 decode step's GPU time goes, per kernel and per kernel category,
     run eagerly and replayed from its CUDA graph, plus compute_logits + sampler (see `step_profile`).
Results: a JSON file (device, versions, commit) and a PNG plot beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from keel.bench import source_commit

DSV2_LITE = {
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
    "n_routed_experts": 64, "num_experts_per_tok": 6, "routed_scaling_factor": 1.0, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "max_position_embeddings": 163840,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": 2, "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
}

_here = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("h200_llama8b", _here / "h200_llama8b.py")
_common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_common)
ceilings, events_ms, hf_generate_throughput = _common.ceilings, _common._events_ms, _common.hf_generate_throughput


def mla_projection_params(cfg: dict) -> int:
    """One MLA layer's projection weights (q, kv_a, kv_b, o; no q LoRA), without its norms."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v, lora = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    return h * heads * (nope + rope) + h * (lora + rope) + lora * heads * (nope + v) + heads * v * h


def active_bytes_b1(cfg: dict, layers: int, elt: int = 2) -> int:
    """Weight bytes one batch-1 decode step reads: every dense weight, only top-k routed experts."""
    h, lora = cfg["hidden_size"], cfg["kv_lora_rank"]
    attn = mla_projection_params(cfg) + lora + 2 * h  # + the kv_a, input and post-attention norms
    dense_mlp = 3 * h * cfg["intermediate_size"]
    expert = 3 * h * cfg["moe_intermediate_size"]
    moe = cfg["n_shared_experts"] * expert + cfg["num_experts_per_tok"] * expert + h * cfg["n_routed_experts"]
    dense_layers = min(cfg["first_k_dense_replace"], layers)
    per_model = attn * layers + dense_mlp * dense_layers + moe * (layers - dense_layers)
    lm_head, embedding_row, final_norm = cfg["vocab_size"] * h, h, h
    return (per_model + lm_head + embedding_row + final_norm) * elt


def per_expert(state: dict, cfg: dict):
    """transformers keeps a MoE layer's experts fused in memory (`mlp.experts.gate_up_proj` /
    `down_proj`, [E, ...]); checkpoints -- and keel's loader -- use the released per-expert names."""
    h, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            t = t if t.shape[-1] == h else t.transpose(1, 2)  # -> [E, 2I, H], gate rows first
            base = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                yield f"{base}{e}.gate_proj.weight", t[e, :inter]
                yield f"{base}{e}.up_proj.weight", t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            t = t if t.shape[-1] == inter else t.transpose(1, 2)  # -> [E, H, I]
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                yield f"{base}{e}.down_proj.weight", t[e]
        else:
            yield name, t


def moe_kernel_vs_loop(cfg: dict) -> dict:
    from keel_kernels_triton.fused_moe.grouped_gemm import fused_experts_triton

    from keel.layers.fused_moe.torch_ref import fused_experts_torch

    e, h, i, k = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    w13 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16, device="cuda") / h**0.5
    w2 = torch.randn(e, h, i, dtype=torch.bfloat16, device="cuda") / i**0.5
    out = {}
    for batch in (1, 64):
        x = torch.randn(batch, h, dtype=torch.bfloat16, device="cuda")
        logits = torch.randn(batch, e, device="cuda")
        weights, ids = torch.topk(torch.softmax(logits, -1), k)
        ref = fused_experts_torch(x, w13, w2, weights, ids)
        got = fused_experts_triton(x, w13, w2, weights, ids)
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        args = (x, w13, w2, weights, ids)
        t_loop = events_ms(lambda args=args: fused_experts_torch(*args), iters=20)
        t_fused = events_ms(lambda args=args: fused_experts_triton(*args), iters=20)
        touched = len(torch.unique(ids))
        bytes_read = touched * 3 * h * i * 2
        out[f"b{batch}"] = {"loop_ms": t_loop, "fused_ms": t_fused, "speedup": t_loop / t_fused,
                            "rel_err": err, "experts_touched": touched,
                            "fused_bw_GBps": bytes_read / t_fused / 1e6}
    return out


# Kernel category by substring of the lower-cased kernel name; the first match wins, so torch's scatter /
# index / sort kernels of the MoE alignment land in moe_routing before their "elementwise" template names
# are looked at, and the embedding's index_select is kept out of routing.
KERNEL_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fused_moe", ("fused_moe",)),
    ("embedding", ("indexselect", "embedding")),
    ("moe_routing", ("routing", "topk", "softmax", "sort", "align", "scatter", "index", "searchsorted", "scan")),
    ("attention", ("mla", "attention", "decode_kernel", "reshape_and_cache")),
    ("gemm", ("nvjet", "cutlass", "cublas", "gemm", "gemv", "xmma", "splitk")),
    ("norm", ("norm",)),
    ("rope", ("rotary", "rope")),
    ("elementwise", ("elementwise", "silu", "act_and_mul", "copy", "fill", "cat", "reduce", "memcpy", "memset")),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in KERNEL_CATEGORIES if any(k in low for k in keys)), "other")


def summarize_kernels(rows: list[tuple[str, int, float]], steps: int = 1, top: int = 40) -> dict:
    """Per-step totals of (kernel name, launches, GPU microseconds) rows covering `steps` steps."""
    cats: dict[str, dict] = {}
    for name, count, us in rows:
        c = cats.setdefault(kernel_category(name), {"count": 0, "ms": 0.0})
        c["count"] += count / steps
        c["ms"] += us / 1e3 / steps
    ranked = sorted(rows, key=lambda r: -r[2])[:top]
    return {
        "total_gpu_ms": sum(r[2] for r in rows) / 1e3 / steps,
        "num_kernels": sum(r[1] for r in rows) / steps,
        "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1]["ms"])),
        "top_kernels": [{"name": n[:140], "category": kernel_category(n), "count": c / steps, "ms": us / 1e3 / steps}
                        for n, c, us in ranked],
    }


def profile_kernels(fn, steps: int = 3) -> dict:
    """CUPTI kernel records of `steps` calls of `fn` (graph replays included), summarized per call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.count, e.device_time_total) for e in prof.key_averages()
            if e.device_type != DeviceType.CPU and e.device_time_total > 0]
    out = summarize_kernels(rows, steps)
    if not rows:
        out["note"] = "the profiler recorded no kernels (CUPTI unavailable, or it misses graph kernels here)"
    return out


def _guarded(fn) -> dict:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 -- a failed profile must not cost the rest of the benchmark
        return {"error": repr(exc)[:400]}


def _decode_b1_common(runner, context_len: int):
    """One request decoding its `context_len`-th token from blocks 1..n. The worker always allocates more
    than max_model_len / block_size blocks beside the null block 0, so these exist; their content is
    whatever is there (timing only)."""
    from keel.attention.metadata import CommonAttentionMetadata

    bs, dev = runner.block_size, runner.device
    nblocks = -(-context_len // bs)
    table = torch.arange(1, nblocks + 1, dtype=torch.int32).view(1, nblocks)
    slot = int(table[0, (context_len - 1) // bs]) * bs + (context_len - 1) % bs
    qsl, seq = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([context_len], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=seq.to(dev), seq_lens_cpu=seq,
        block_table=table.to(dev), slot_mapping=torch.tensor([slot], device=dev), num_reqs=1, num_actual_tokens=1,
        max_query_len=1, max_seq_len=context_len, block_size=bs)


@torch.inference_mode()
def step_profile(engine, context_len: int = 192, iters: int = 20) -> dict:
    """Where a batch-1 decode step's GPU time goes, on an idle engine (no unfinished requests): the model
    forward run eagerly and replayed from its captured CUDA graph (per kernel, per category, CUDA-event
    medians of `iters`), and compute_logits + greedy sampling with the step's host sync. Writes one token's
    latent into KV blocks 1..n and then drops the prefix cache. Each part records its error instead of
    raising."""
    from keel.engine.sampling_params import SamplingParams
    from keel.forward_context import ForwardContext
    from keel.layers.sampling_metadata import SamplingMetadata

    if engine.has_unfinished_requests():
        return {"error": "step_profile needs an idle engine (it writes into KV blocks 1..n)"}
    runner = engine.core.worker.runner
    model, dev = runner.model, runner.device
    context_len = min(context_len, runner.max_model_len or context_len)
    common = _decode_b1_common(runner, context_len)
    ids = torch.tensor([5], dtype=torch.int64, device=dev)
    pos = torch.tensor([context_len - 1], dtype=torch.int64, device=dev)
    metas = [b.build(common) for b in runner._builders]  # as ModelRunner.execute_model's eager path does
    ctx = ForwardContext(attn_metadata=[metas[i] for i in runner._layer_builder], kv_caches=runner.kv_caches,
                         num_actual_tokens=1)
    result: dict = {"batch_size": 1, "context_len": context_len}

    def eager() -> dict:
        return {"forward_ms": events_ms(lambda: model(ids, pos, ctx), iters=iters),
                **profile_kernels(lambda: model(ids, pos, ctx))}

    def graph() -> dict:
        graphs = runner.cuda_graphs
        if graphs is None:
            return {"skipped": "no decode CUDA graphs (enforce_eager, or a backend refused capture)"}
        if graphs.run(ids, pos, common) is None:  # loads the static inputs; None: this step cannot replay
            return {"error": f"a batch-1 decode step does not replay (captured sizes {graphs.sizes})"}
        b = graphs.bucket(1)
        g, _ = graphs.graphs[(1, b)]  # keyed by (query length, batch size)
        return {"captured_batch": b, "replay_ms": events_ms(g.replay, iters=iters), **profile_kernels(g.replay)}

    def logits_sampler() -> dict:
        hidden = model(ids, pos, ctx)  # [1, hidden_size]
        vocab = model.compute_logits(hidden).shape[-1]
        meta = SamplingMetadata.build([SamplingParams(temperature=0)], [[]], [[5]], [0], vocab, dev, [set()])

        def both() -> torch.Tensor:  # with the step's one host sync, as ModelRunner._sample_one_each
            return runner.sampler(model.compute_logits(hidden), meta).sampled_token_ids.cpu()

        return {"compute_logits_ms": events_ms(lambda: model.compute_logits(hidden), iters=iters),
                "compute_logits_sampler_ms": events_ms(both, iters=iters),
                "kernels": profile_kernels(both)}

    result["eager"] = _guarded(eager)
    result["graph"] = _guarded(graph)
    result["logits_sampler"] = _guarded(logits_sampler)
    engine.core.scheduler.kv.reset_prefix_cache()
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ax = axes[0]
    ax.bar(["memory floor", "keel b=1"], [result["memory_floor_b1_ms"], result["decode_b1_ms_per_token"]],
           color=["grey", "tab:blue"])
    ax.set_ylabel("ms per output token")
    ax.set_title("batch-1 decode")
    ax = axes[1]
    ax.bar(["transformers b=64", "keel"], [result["hf_throughput_b64_tok_s"], result["throughput_output_tok_s"]],
           color=["grey", "tab:blue"])
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"throughput ({result['speedup_vs_hf_b64']:.1f}x transformers)")
    ax = axes[2]
    moe = result["moe"]
    labels = list(moe)
    ax.bar([f"{b} loop" for b in labels], [moe[b]["loop_ms"] for b in labels], color="grey")
    ax.bar([f"{b} fused" for b in labels], [moe[b]["fused_ms"] for b in labels], color="tab:blue")
    ax.set_ylabel("ms per MoE layer")
    ax.set_title("fused MoE vs per-expert loop")
    fig.suptitle(f"{result['device']} -- DeepSeek-V2-Lite shape, random weights, bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/h200-dsv2lite.json")
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--hf-prompts", type=int, default=64)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    ap.add_argument("--mtp-only", action="store_true", help="only the MTP step cost, merged into --out")
    ap.add_argument("--profile-only", action="store_true",
                    help="only the batch-1 decode step profile (dummy weights), merged into --out")
    ns = ap.parse_args()
    if ns.mtp_only or ns.profile_only:
        shape = {**DSV2_LITE, "num_hidden_layers": ns.layers}
        key = "mtp" if ns.mtp_only else "step_profile"
        out = Path(ns.out)
        result = json.loads(out.read_text()) if out.exists() else {}
        result[key] = mtp_step_cost(shape, 0.0) if ns.mtp_only else profile_only(shape, ns.eager)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=str))
        print(f"{key}:", json.dumps(result[key], indent=1, default=str))
        return

    import transformers
    import triton
    from transformers import AutoModelForCausalLM

    from keel.bench import random_prompts, run_latency, run_throughput

    shape = {**DSV2_LITE, "num_hidden_layers": ns.layers}
    result: dict = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "commit": source_commit(_here) or "unknown",
        "model_shape": shape, "dtype": "bfloat16", "enforce_eager": ns.eager,
    }
    result.update(ceilings())
    torch.cuda.empty_cache()
    result["moe"] = moe_kernel_vs_loop(shape)
    print("moe:", result["moe"], flush=True)

    cfg, model_dir = write_config(shape)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()

    t0 = time.perf_counter()
    engine = make_engine(model_dir, ns.eager)
    result["engine_init_s"] = time.perf_counter() - t0
    runner = engine.core.worker.runner
    runner.model.load_weights(per_expert(hf.state_dict(), shape))  # the very same weights as transformers
    runner.model.process_weights_after_loading()  # MLA re-absorbs kv_b_proj
    engine.core.scheduler.kv.reset_prefix_cache()
    # After this hand load the first timed prefill steps compiled kernels again (~7.6 s on the H200,
    # h200-dsv2lite-throughput.json; a normal start loads before its warm-up): warm up once more. The decode
    # graphs stay valid: the loads and triton_mla's re-absorption write into the tensors they captured.
    engine.core.worker.warm_up()
    result["attention_backends"] = sorted({layer.backend.name for layer in runner.attn_layers})
    result["weight_bytes_total"] = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    result["weight_bytes_b1_step"] = active_bytes_b1(shape, ns.layers)
    result["memory_floor_b1_ms"] = result["weight_bytes_b1_step"] / (result["copy_bw_GBps"] * 1e9) * 1e3
    print("engine ready", {k: result[k] for k in ("engine_init_s", "attention_backends", "memory_floor_b1_ms")},
          flush=True)

    vocab = cfg.vocab_size
    lat = run_latency(engine, 1, 128, 128, 3, vocab)
    result["latency_b1"] = lat
    result["decode_b1_ms_per_token"] = lat["time_per_output_token_ms"]
    result["decode_b1_vs_floor"] = lat["time_per_output_token_ms"] / result["memory_floor_b1_ms"]
    print("latency:", lat, flush=True)

    run_throughput(engine, random_prompts(8, 128, vocab, seed=99), 4)  # warm-up, prompts not reused below
    thr = run_throughput(engine, random_prompts(ns.num_prompts, 128, vocab, seed=0), 128)
    result["throughput"] = thr
    result["throughput_output_tok_s"] = thr["output_tokens_per_s"]
    print("throughput:", thr, flush=True)

    result["greedy_first_token_agreement_bf16"] = _common.greedy_first_token_agreement(engine, hf, vocab)
    result["step_profile"] = with_unexplained(_guarded(lambda e=engine: step_profile(e)),
                                              result["decode_b1_ms_per_token"])
    print("step profile:", json.dumps(result["step_profile"], default=str), flush=True)
    engine.shutdown()
    del engine, runner
    torch.cuda.empty_cache()

    try:
        result["mtp"] = mtp_step_cost(shape, result["copy_bw_GBps"])
    except Exception as exc:  # noqa: BLE001 -- keep the rest of the run; record why
        result["mtp"] = {"error": repr(exc)[:400]}
    print("mtp:", result["mtp"], flush=True)

    hf_prompts = random_prompts(ns.hf_prompts, 128, vocab, seed=1)
    result["hf_b64"] = hf_generate_throughput(hf, hf_prompts, 128, 64)
    result["hf_throughput_b64_tok_s"] = result["hf_b64"]["output_tokens_per_s"]
    result["speedup_vs_hf_b64"] = result["throughput_output_tok_s"] / result["hf_throughput_b64_tok_s"]
    print("hf:", result["hf_b64"], flush=True)

    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("decode_b1_ms_per_token", "memory_floor_b1_ms",
                                             "throughput_output_tok_s", "hf_throughput_b64_tok_s",
                                             "speedup_vs_hf_b64")}, indent=2))


def write_config(shape: dict):
    """A DeepSeek-V2 config of `shape` in a fresh temp dir: (config, its directory)."""
    from transformers import DeepseekV2Config

    cfg = DeepseekV2Config(**shape)
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    model_dir = Path(tempfile.mkdtemp()) / "dsv2lite"
    cfg.save_pretrained(model_dir)
    return cfg, model_dir


def make_engine(model_dir: Path, eager: bool):
    """The benchmarked engine: profile `cuda`, dummy weights (main() then loads transformers' tensors)."""
    from keel.config import EngineArgs
    from keel.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs(
        model=str(model_dir), profile="cuda", load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
        max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.6,
        enforce_eager=eager))


def with_unexplained(profile: dict, decode_ms_per_token: float) -> dict:
    """Adds what a measured decode token costs beyond the forward (graph replay; the eager forward when no
    graphs were captured) + logits + sampler: host work and gaps between launches."""
    graph = profile.get("graph", {})
    forward = profile.get("eager", {}).get("forward_ms") if "skipped" in graph else graph.get("replay_ms")
    sampling = profile.get("logits_sampler", {}).get("compute_logits_sampler_ms")
    if forward is not None and sampling is not None:
        profile["decode_b1_ms_per_token"] = decode_ms_per_token
        profile["outside_forward_and_sampling_ms"] = decode_ms_per_token - forward - sampling
    return profile


def profile_only(shape: dict, eager: bool) -> dict:
    """--profile-only: the step profile of a dummy-weight engine, plus one measured decode token for context."""
    from keel.bench import run_latency

    cfg, model_dir = write_config(shape)
    engine = make_engine(model_dir, eager)
    try:
        lat = _guarded(lambda: run_latency(engine, 1, 128, 64, 2, cfg.vocab_size))
        prof = _guarded(lambda: step_profile(engine))
        if "time_per_output_token_ms" in lat:
            prof = with_unexplained(prof, lat["time_per_output_token_ms"])
        prof["weights"] = "dummy"
        prof["enforce_eager"] = eager
        return prof
    finally:
        engine.shutdown()


def mtp_step_cost(shape: dict, copy_bw: float) -> dict:
    """Batch-1 decode step time with one MTP draft against a plain decode step, on a DeepSeek-V3-style
    model of the same V2-Lite dimensions (V2 has no MTP module) with dummy weights. Random weights accept
    almost no draft, so this is the cost side: what an MTP step adds to a decode step."""
    from transformers import DeepseekV3Config

    from keel.bench import run_latency
    from keel.config import EngineArgs
    from keel.engine.llm_engine import LLMEngine

    v3 = {k: v for k, v in shape.items() if k not in ("topk_method",)}
    v3.update(num_nextn_predict_layers=1, n_group=1, topk_group=1, norm_topk_prob=True)
    cfg = DeepseekV3Config(**v3)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    model_dir = Path(tempfile.mkdtemp()) / "dsv3-litedims"
    cfg.save_pretrained(model_dir)
    out: dict = {}
    for name, spec in (("plain", None), ("mtp_k1", {"method": "mtp", "num_speculative_tokens": 1})):
        engine = LLMEngine.from_engine_args(EngineArgs(
            model=str(model_dir), profile="cuda", load_format="dummy", dtype="bfloat16",
            skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=8, num_kv_blocks=2048,
            speculative_config=spec))
        lat = run_latency(engine, 1, 128, 64, 2, cfg.vocab_size)
        metrics = engine.get_metrics()
        out[name] = {"ms_per_output_token": lat["time_per_output_token_ms"],
                     "drafts": metrics["spec_decode_num_draft_tokens_total"],
                     "accepted": metrics["spec_decode_num_accepted_tokens_total"]}
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()
    out["mtp_step_over_plain"] = out["mtp_k1"]["ms_per_output_token"] / out["plain"]["ms_per_output_token"]
    return out


if __name__ == "__main__":
    main()
