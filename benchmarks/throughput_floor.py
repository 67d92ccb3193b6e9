"""The physical floor of the side-by-side throughput workload (issue 11's harness), from the model's shape
and the H200's measured rates -- what 1.3x / 1.2x vLLM would ask of the GPU.

    python benchmarks/throughput_floor.py [--out benchmarks/results/throughput-floor.json]

CPU only: arithmetic over the shapes in h200_llama8b.py / h200_dsv2lite.py and rates measured on the H200
(copy bandwidth and an 8192^3 bf16 matmul: h200-llama8b.json; the bf16 cuBLAS GEMM rate at M 256 and 8192
on the Llama layer shapes: h200-block-fp8-gemm-*.json), against the steps keel measured
(the h200-step-profile files in PROFILES).

The workload: 1000 prompts of 128 tokens, 128 out, max_num_seqs 256, max_num_batched_tokens 8192. All
requests have the same lengths, so it runs as ~4 waves: 256 prompts prefilled (4 steps of 8192 tokens),
then 128 decode steps of 256 requests. Floors per step:
- prefill: GEMM FLOPs (2 x active weights, no LM head: only the last position is sampled) / matmul rate;
- decode at batch 256: GEMM time (the larger of its FLOPs at the M-256 GEMM rate and its weight bytes at
  copy bandwidth) plus attention's KV bytes at copy bandwidth (separate kernels: the two do not overlap).
  Routed experts: every expert is read at batch 256 (1536 picks over 64 experts leave none idle).
Also Llama-8B in fp8 (issue 12's 30,000 out tok/s), with a bf16 and with an fp8 KV cache. `--max-num-seqs 1024`
(`throughput-floor-seqs1024.json`): the same workload with every request decoding at once, at the GEMM rates
measured at M = 1024 -- the batch TensorRT-LLM's published figure runs at, not issue 11's harness.
Attention FLOPs of 128-token prompts, norms and rope are left out (under 3% of a prefill step).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
from pathlib import Path

_here = Path(__file__).resolve().parent
RESULTS = _here / "results"
NUM_PROMPTS, PROMPT, OUTPUT, SEQS, BATCHED = 1000, 128, 128, 256, 8192


def llama_shape() -> dict:
    h, inter, layers, heads, kv = 4096, 14336, 32, 32, 8
    hd = h // heads
    per_layer = h * (heads + 2 * kv) * hd + h * h + 3 * h * inter
    return {"prefill_params": layers * per_layer, "decode_params": layers * per_layer + 128256 * h,
            "decode_weight_params": layers * per_layer + 128256 * h, "kv_bytes_per_token": layers * 2 * kv * hd * 2}


def dsv2lite_shape() -> dict:
    from h200_dsv2lite import DSV2_LITE as c, mla_projection_params  # benchmarks/ is on sys.path here

    h, layers = c["hidden_size"], c["num_hidden_layers"]
    attn = mla_projection_params(c)
    expert = 3 * h * c["moe_intermediate_size"]
    active_moe = (c["num_experts_per_tok"] + c["n_shared_experts"]) * expert  # per token
    all_moe = (c["n_routed_experts"] + c["n_shared_experts"]) * expert  # every routed expert is read at batch 256
    dense = 3 * h * c["intermediate_size"]  # layer 0
    lm_head = c["vocab_size"] * h
    return {"prefill_params": layers * attn + dense + (layers - 1) * active_moe,
            "decode_params": layers * attn + dense + (layers - 1) * active_moe + lm_head,
            "decode_weight_params": layers * attn + dense + (layers - 1) * all_moe + lm_head,
            "kv_bytes_per_token": layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2}


def measured_rates() -> dict:
    llama = json.loads((RESULTS / "h200-llama8b.json").read_text())
    gemm_file = sorted(glob.glob(str(RESULTS / "h200-block-fp8-gemm-*.json")))[-1]
    rows = json.loads(Path(gemm_file).read_text())["rows"]

    def rate(m: int, path: str) -> float:  # FLOP-weighted rate over the four Llama layer shapes at M = m
        sel = [r for r in rows if r["m"] == m]
        flops = [2 * m * r["n"] * r["k"] for r in sel]
        return sum(flops) / sum(f / r[f"{path}_TFLOPS"] for f, r in zip(flops, sel, strict=True))

    out = {"copy_GBps": llama["copy_bw_GBps"], "matmul_8192cubed_TFLOPs": llama["bf16_matmul_TFLOPs"],
           "gemm_M8192_TFLOPs": rate(8192, "bf16_cublas"), "gemm_M256_TFLOPs": rate(256, "bf16_cublas"),
           # fp8 weights and activations, the faster of cuBLAS's row-wise and block-scaled GEMMs
           "fp8_gemm_M8192_TFLOPs": max(rate(8192, p) for p in ("fp8_rowwise_scaled_mm", "cublas_block")),
           "fp8_gemm_M256_TFLOPs": max(rate(256, p) for p in ("fp8_rowwise_scaled_mm", "cublas_block")),
           "gemm_file": Path(gemm_file).name}
    if SEQS not in (256, 8192):  # --max-num-seqs: the decode GEMMs' rate at that M, where the file measured it
        if not any(r["m"] == SEQS for r in rows):
            raise SystemExit(f"--max-num-seqs {SEQS}: {Path(gemm_file).name} measured M in "
                             f"{sorted({r['m'] for r in rows})} only")
        out[f"gemm_M{SEQS}_TFLOPs"] = rate(SEQS, "bf16_cublas")
        out[f"fp8_gemm_M{SEQS}_TFLOPs"] = max(rate(SEQS, p) for p in ("fp8_rowwise_scaled_mm", "cublas_block"))
    return out


def floor(shape: dict, rates: dict, ctx_tokens: float, fp8: bool = False, fp8_kv: bool = False) -> dict:
    """fp8: e4m3 weights (1 byte) at the fp8 GEMM rates; fp8_kv: a 1-byte KV cache."""
    bw = rates["copy_GBps"] * 1e9
    pre = "fp8_" if fp8 else ""
    prefill_ms = 2 * BATCHED * shape["prefill_params"] / (rates[f"{pre}gemm_M8192_TFLOPs"] * 1e12) * 1e3
    batch = min(SEQS, NUM_PROMPTS)  # requests decoding together (all of them when max_num_seqs holds them)
    gemm_ms = max(2 * batch * shape["decode_params"] / (rates[f"{pre}gemm_M{SEQS}_TFLOPs"] * 1e12),
                  (1 if fp8 else 2) * shape["decode_weight_params"] / bw) * 1e3
    attn_ms = batch * ctx_tokens * shape["kv_bytes_per_token"] / (2 if fp8_kv else 1) / bw * 1e3
    waves = NUM_PROMPTS / batch
    prefill_steps = math.ceil(batch * PROMPT / BATCHED)
    total_s = waves * (prefill_steps * prefill_ms + OUTPUT * (gemm_ms + attn_ms)) / 1e3
    return {"prefill_step_ms": prefill_ms, "decode_step_ms": gemm_ms + attn_ms, "decode_gemm_ms": gemm_ms,
            "decode_attention_ms": attn_ms, "workload_s": total_s, "out_tok_s": NUM_PROMPTS * OUTPUT / total_s}


# keel's newest step profiles with a prefill step and a batch-256 decode step
PROFILES = {"llama8b": "h200-step-profile-llama8b-148f8e5.json",
            "dsv2lite": "h200-step-profile-dsv2lite-8f461cc.json"}


def keel_steps(arch: str, f: dict) -> dict:
    d = json.loads((RESULTS / PROFILES[arch]).read_text())
    prefill = d["prefill"]["total_gpu_ms"]
    decode = next(b for b in d["decode"] if b["batch"] == 256)["gpu_ms_per_step"]
    return {"file": PROFILES[arch], "prefill_step_gpu_ms": prefill, "decode_b256_gpu_ms": decode,
            "prefill_of_floor": f["prefill_step_ms"] / prefill, "decode_of_floor": f["decode_step_ms"] / decode}


def main() -> None:
    global SEQS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(RESULTS / "throughput-floor.json"))
    ap.add_argument("--max-num-seqs", type=int, default=SEQS,
                    help="requests decoding together (an M the GEMM file measured, e.g. 1024: issue 12's fp8 target "
                         "beside TensorRT-LLM's large-batch figure); keel's measured steps only at 256")
    ns = ap.parse_args()
    SEQS = ns.max_num_seqs
    rates = measured_rates()
    out = {"workload": {"num_prompts": NUM_PROMPTS, "prompt": PROMPT, "output": OUTPUT, "max_num_seqs": SEQS,
                        "max_num_batched_tokens": BATCHED}, "rates": rates, "models": {}}
    # mean context of a decoding request over its 128 steps: the prompt plus half the output
    for name, shape in (("llama8b", llama_shape()), ("dsv2lite", dsv2lite_shape())):
        f = floor(shape, rates, PROMPT + OUTPUT / 2)
        if SEQS == 256:  # the profiles ran batch-256 decode steps
            f["keel_measured_steps"] = keel_steps(name, f)
        out["models"][name] = f
        print(name, json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in f.items()}))
    # issue 12's fp8 target (30,000 out tok/s) on the same workload
    for key, kv in (("llama8b_fp8", False), ("llama8b_fp8_kv_fp8", True)):
        f = floor(llama_shape(), rates, PROMPT + OUTPUT / 2, fp8=True, fp8_kv=kv)
        out["models"][key] = f
        print(key, json.dumps({k: round(v, 2) for k, v in f.items()}))
    Path(ns.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
