"""Mid-size fp8 GEMMs (per-row weights, per-token activations: Llama fp8's path from 2 tokens up) at Llama-3-8B's
layer shapes: torch._scaled_mm (cuBLASLt, what keel runs) against the Triton W8A8 GEMM (`fp8_triton`) in a few
tiles and K splits, and bf16 cuBLAS on a ready weight; per M the four layers' total, and each tile's largest
difference from _scaled_mm's output. Both fp8 paths time the GEMM alone, on activations quantized once (the same
launch, `quant_fp8`, precedes either; its time is reported beside them).

    python benchmarks/h200_fp8_mid_m.py --out benchmarks/results/h200-fp8-mid-m.json

Why: in the H200's fp8 step profile (h200-step-profile-llama8b-fp8-186f88e.json) the batch-256 decode step spends
3.85 of its 7.5 GPU ms in cuBLAS's fp8 GEMMs, every one in the same 128 x 128 tile (nvjet ... 128x128 ... coopA,
no split): o_proj and down_proj (N 4096) are 2 x 32 = 64 tiles for 132 SMs, qkv 96 -- the device half idle on
three of the four layers, while vLLM (0.96x keel's time per token at fp8 on the H100, h100-vs-vllm-d5be3fb.json)
runs CUTLASS kernels picked per M bucket. Split K or smaller tiles fill the device.
Prediction (before any run): at M = 256 a Triton tile's rate per busy SM is ~0.6-0.8x cuBLAS's, so with twice
the SMs busy o / down / qkv take ~0.7-0.9x cuBLAS's time and gate_up (448 tiles) 1.2-1.5x; a plan taking the
first three would cut the four layers ~10% (~0.4 ms of the H200's 256-token step). Nothing is routed by this
script: a win here is the case for a plan file like `int4_mma_configs`.
Each tile runs in two forms: the kernel's per-K-tile scaling (as `fp8_gemm` runs today: two multiplies and an add
per output element a K tile, and 34 scalar scale loads at 128 x 128, the MMA waited for before them) and
SCALE_AFTER (the tiles' products summed in the accumulator, promoted to float32 every K tile, scaled once after the
loop). sm_90 SASS (Triton 3.6), 128 x 128 x 128 at 8 warps: 358 -> 170 loop instructions and 255 -> 169 registers;
per SM a K tile is ~512 clocks of fp8 MMA against ~716 of issue before, ~340 after. Prediction: the SCALE_AFTER
tiles 1.3-1.8x faster than the per-tile ones from M 128.
Timing: CUDA-graph replays cycling through weight copies past the L2 (h200_quant.graph_us), as decode steps run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

_here = Path(__file__).resolve().parent
MS = (64, 128, 256, 512)
# (BLOCK_M tokens, BLOCK_N weight rows, num_warps, num_stages, split_k); BLOCK_K 128
TILES = [(128, 128, 8, 3, 1), (128, 128, 8, 3, 2), (64, 128, 4, 4, 1), (64, 128, 4, 4, 2), (64, 128, 4, 4, 4),
         (128, 64, 4, 4, 1), (128, 64, 4, 4, 2), (64, 64, 4, 4, 2), (64, 64, 4, 4, 4), (128, 256, 8, 3, 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/h200-fp8-mid-m.json")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--budget-s", type=float, default=90.0)
    ns = ap.parse_args()
    import triton

    from keel.bench import source_commit
    from keel_quantization import fp8_triton
    from keel_quantization.fp8_quant_triton import quant_fp8
    from keel_quantization.small_m_plan import SmallMPlan

    from keel.testing.scripts import load_script

    # the int4 sweep's shapes, the small-M sweep's weight copies, the quantized engine's graph timing (each file
    # executed once)
    prefill, small_m, quant = (load_script(_here / f"{name}.py")
                               for name in ("h200_int4_prefill", "h200_quant_small_m", "h200_quant"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    # per layer, copies of its fp8 weight and per-row scale [N, 1] past 256 MiB together (the small-M sweep's)
    copies = {name: small_m._weights("fp8_row", n, k, gen)[0] for name, (n, k) in prefill.SHAPES.items()}
    # per layer, the same weight dequantized [N, K] for bf16 cuBLAS, and copies past the L2
    dense = {name: quant.past_l2((w[0][0].to(torch.float32) * w[0][1]).to(torch.bfloat16))
             for name, w in copies.items()}
    # each tile in the kernel's per-K-tile scaling (as fp8_gemm runs today) and with the per-row scales applied
    # once after the loop (SCALE_AFTER, label " a")
    tiles = {f"triton {bm}x{bn} w{w} s{st}" + (f" k{sp}" if sp > 1 else "") + (" a" if after else ""):
             (SmallMPlan("dot", bm, bn, 128, sp, num_warps=w, num_stages=st), after)
             for after in (False, True) for bm, bn, w, st, sp in TILES}
    t0 = time.perf_counter()
    rows = []
    for m in (int(v) for v in ns.ms.split(",")):
        for name, (n, k) in prefill.SHAPES.items():
            w = copies[name]  # [(e4m3 [N, K], float32 [N, 1])]
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            a_q, a_s = quant_fp8(x, k)  # [M, K] e4m3, [M, 1] float32
            ref = torch._scaled_mm(a_q, w[0][0].t(), scale_a=a_s, scale_b=w[0][1].reshape(1, -1),
                                   out_dtype=torch.bfloat16).float()
            fns = {"scaled_mm": (len(w), lambda i: torch._scaled_mm(a_q, w[i][0].t(), scale_a=a_s,
                                                                    scale_b=w[i][1].reshape(1, -1),
                                                                    out_dtype=torch.bfloat16)),
                   "quant_fp8": (1, lambda i: quant_fp8(x, k)),
                   "bf16_cublas": (len(dense[name]), lambda i: x @ dense[name][i].t())}
            for label, (plan, after) in tiles.items():
                fns[label] = (len(w), lambda i, plan=plan, after=after: fp8_triton._launch(
                    a_q, a_s, w[i][0], w[i][1], 1, k, torch.bfloat16, plan, None, scale_after=after))
            row = {"m": m, "layer": name, "n": n, "k": k, "us": {}, "max_rel_diff": {}}
            quant.time_paths(row, fns, ref, "triton", lambda: time.perf_counter() - t0 > ns.budget_s)
            rows.append(row)
            print(json.dumps({k_: row[k_] for k_ in ("m", "layer", "us")}, default=lambda v: round(v, 1)), flush=True)
    totals = quant.totals_per_m(rows, len(prefill.SHAPES))
    # per M: the best tile per layer shape, summed (what a per-shape plan would run), against _scaled_mm's total
    per_shape_best = {}
    for m in totals:
        best = [min(((us, lb) for lb, us in r["us"].items() if lb.startswith("triton") or lb == "scaled_mm"),
                    default=(float("nan"), None)) for r in rows if r["m"] == m]
        per_shape_best[m] = {"us": sum(b[0] for b in best), "choices": [b[1] for b in best]}
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": source_commit(_here) or "unknown", "rows": rows, "us_per_four_layers": totals,
              "per_shape_best": per_shape_best}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=1, default=float))
    print(json.dumps({"us_per_four_layers": totals, "per_shape_best": per_shape_best}, indent=1,
                     default=lambda v: round(v, 1) if isinstance(v, float) else v))


if __name__ == "__main__":
    main()
