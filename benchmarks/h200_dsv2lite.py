"""keel vs HuggingFace transformers on one GPU, DeepSeek-V2-Lite shape, random weights, bf16.

    python benchmarks/h200_dsv2lite.py [--out benchmarks/results/h200-dsv2lite.json] [--layers 27]
        [--num-prompts 256] [--hf-prompts 64] [--eager]

One run measures on the same device:
  1. the ceilings (copy bandwidth, bf16 matmul), as in h200_llama8b.py;
  2. transformers' DeepseekV2ForCausalLM built with random weights on the GPU; keel's engine (profile
     `cuda`, load_format="dummy") then loads those same tensors;
  3. keel batch-1 decode (128-token prompt, 128 output tokens) against the memory floor of the bytes a
     batch-1 step actually reads: attention + dense/shared MLPs + the 6 routed experts per MoE layer +
     norms + lm_head (not all 64 experts);
  4. keel offline throughput (num_prompts of 128 in / 128 out) and transformers generate() at batch 64;
  5. the fused MoE kernel against the per-expert loop (torch reference) at batch 1 and 64, one layer;
  6. if the `mtp` spec decoder is installed: the cost of a one-draft MTP step against a plain decode step.
Results: a JSON file (device, versions, commit) and a PNG plot beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

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


def active_bytes_b1(cfg: dict, layers: int, elt: int = 2) -> int:
    """Weight bytes one batch-1 decode step reads: every dense weight, only top-k routed experts."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v, lora = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    attn = h * heads * (nope + rope) + h * (lora + rope) + lora * heads * (nope + v) + heads * v * h + lora + 2 * h
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
    from keel.layers.fused_moe.torch_ref import fused_experts_torch
    from keel.layers.fused_moe.triton_moe import fused_experts_triton

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
    ns = ap.parse_args()
    if ns.mtp_only:
        out = Path(ns.out)
        result = json.loads(out.read_text()) if out.exists() else {}
        result["mtp"] = mtp_step_cost({**DSV2_LITE, "num_hidden_layers": ns.layers}, 0.0)
        out.write_text(json.dumps(result, indent=2, default=str))
        print("mtp:", result["mtp"])
        return

    import transformers
    import triton
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    from keel.bench import random_prompts, run_latency, run_throughput
    from keel.config import EngineArgs
    from keel.engine.llm_engine import LLMEngine

    shape = {**DSV2_LITE, "num_hidden_layers": ns.layers}
    result: dict = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 check=False).stdout.strip() or os.environ.get("KEEL_COMMIT", "unknown"),
        "model_shape": shape, "dtype": "bfloat16", "enforce_eager": ns.eager,
    }
    result.update(ceilings())
    torch.cuda.empty_cache()
    result["moe"] = moe_kernel_vs_loop(shape)
    print("moe:", result["moe"], flush=True)

    cfg = DeepseekV2Config(**shape)
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    model_dir = Path(tempfile.mkdtemp()) / "dsv2lite"
    cfg.save_pretrained(model_dir)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()

    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(model_dir), profile="cuda", load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
        max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.6,
        enforce_eager=ns.eager))
    result["engine_init_s"] = time.perf_counter() - t0
    runner = engine.core.worker.runner
    runner.model.load_weights(per_expert(hf.state_dict(), shape))  # the very same weights as transformers
    runner.model.process_weights_after_loading()  # MLA re-absorbs kv_b_proj
    engine.core.scheduler.kv.reset_prefix_cache()
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

    prompts = random_prompts(ns.num_prompts, 128, vocab, seed=0)
    run_throughput(engine, prompts[:8], 4)
    thr = run_throughput(engine, prompts, 128)
    result["throughput"] = thr
    result["throughput_output_tok_s"] = thr["output_tokens_per_s"]
    print("throughput:", thr, flush=True)

    result["greedy_first_token_agreement_bf16"] = _common.greedy_first_token_agreement(engine, hf, vocab)
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
