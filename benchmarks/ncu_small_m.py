"""Decode-size quantized GEMMs for Nsight Compute: what bounds them (DRAM throughput, issue slots, stalls).

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        --section MemoryWorkloadAnalysis -k regex:'gemv_fold|w8a8_small_m' python benchmarks/ncu_small_m.py

Runs Llama-3-8B's four layer shapes at M = 1 through the shipped plans: GPTQ int4 group 128 (gemv_fold) and
the W8A8 small-M GEMM per row (dynamic per-token activations); each GEMM twice over weights larger than L2
(ncu replays a kernel with its caches flushed anyway). No timing here: ncu's numbers are the result.
`--fold-plans 1x8x1024,1x16x1024x2s2` adds gemv_fold launches with those plans (BMxBNxBK[xSPLIT][sSTAGES][wWARPS])
after the shipped ones, on every shape: how the stall mix moves with tile, split and pipeline depth (ncu's grid
column tells the launches apart). Part `ncu-small-m` of h200_run.sh runs it with stall reasons
(benchmarks/ncu_stalls.py reads the CSV).
"""

from __future__ import annotations

import argparse
import re

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def fold_plan(text: str):
    """'1x16x1024x2s2w8' -> SmallMPlan('gemv_fold', 1, 16, 1024, split 2, num_stages 2, num_warps 8)."""
    from keel_quantization.small_m_plan import SmallMPlan

    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)(?:x(\d+))?(?:s(\d+))?(?:w(\d+))?", text)
    if m is None:
        raise SystemExit(f"ncu_small_m: a fold plan is BMxBNxBK[xSPLIT][sSTAGES][wWARPS], not {text!r}")
    bm, bn, bk, split, stages, warps = m.groups()
    return SmallMPlan("gemv_fold", int(bm), int(bn), int(bk), int(split or 1), num_warps=int(warps or 4),
                      num_stages=int(stages) if stages else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fold-plans", default="", help="more gemv_fold plans, comma-separated")
    args = ap.parse_args()
    extra = [fold_plan(t) for t in args.fold_plans.split(",") if t]
    from keel_quantization import fp8_math
    from keel_quantization.fp8_w8a8_small_m_triton import fp8_w8a8_small_m_gemm
    from keel_quantization.int4_triton import int4_gemm

    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        words = torch.randint(-(1 << 31), 1 << 31, (k // 8, n), device="cuda", generator=gen,
                              dtype=torch.int64).to(torch.int32)
        scales = torch.rand(k // 128, n, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.01
        zeros = torch.full_like(scales, 8.0)
        g_idx = torch.arange(k, device="cuda", dtype=torch.int32) // 128
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
        q, s = fp8_math.quantize_per_row(w)
        del w
        for _ in range(2):
            int4_gemm(x, words, scales, zeros, g_idx, group_size=128)
            fp8_w8a8_small_m_gemm(x, q, s[:, None], 1, k, "dynamic_token")
        for plan in extra:
            for _ in range(2):
                int4_gemm(x, words, scales, zeros, g_idx, group_size=128, plan=plan)
        torch.cuda.synchronize()
        print(name, n, k, "done", flush=True)


if __name__ == "__main__":
    main()
