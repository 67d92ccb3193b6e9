"""Block FP8 GEMMs at prefill / large-batch M: cuBLAS's block-scaled GEMM against the Triton W8A8 block
GEMM, bf16 cuBLAS and fp8 row-wise torch._scaled_mm (the per-tensor checkpoint's path), on Llama-3-8B's four
layer shapes at M = 64, 256, 1024, 8192. Each fp8 path includes its activation quantization launch (the
layer pays it).

    python benchmarks/h200_block_fp8_gemm.py --out benchmarks/results/h200-block-fp8-gemm.json

CUDA-graph replays over weight copies larger than L2 (h200_quant.graph_us), microseconds per call and
TFLOPS (2 M N K / time); the ratio of each path to bf16; which path `choose_native` gives each shape (and
why); cuBLAS block against Triton block on the same operands (largest difference over the largest output:
both multiply the same fp8 numbers). About 30 s on an H200.

Prediction (written before the first run): bf16 cuBLAS ~600-700 TFLOPS at M 8192 and ~450-550 at 1024;
Triton block ~0.7x bf16 at M >= 1024 (the engine's 14.0k vs 16.0k out tok/s); cuBLAS block ~1.3-1.5x bf16
at M >= 1024 (~850-1000 TFLOPS at 8192), a little under row-wise _scaled_mm (~1.5-1.7x: the per-128-K
scale promotion costs cuBLAS some of fp8's 2x), ~1.1-1.3x bf16 at M 256 (half the weight bytes, plus the
quantization launch), and at M 64 at or above Triton block (~1.0-1.3x). In the engine that predicts block
fp8 Llama-8B at ~19-20k out tok/s (per-tensor 20.7k), DSV2-Lite block a few percent up only (its routed
experts stay on the Triton grouped GEMM).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

MS = (64, 256, 1024, 8192)  # 64: near the weight-only bound (M <= 32), where cuBLAS block starts


def _paths(x: torch.Tensor, per_row: list, block: list, cublas: list, dense: list) -> dict:
    """path -> (weight copies, fn(copy index))."""
    from keel_quantization.fp8_native import native_linear

    return {
        "bf16_cublas": (len(dense), lambda i: x @ dense[i].T),
        "triton_block": (len(block), lambda i: native_linear("triton", x, *block[i], "dynamic_group", (128, 128),
                                                             None, None)),
        "cublas_block": (len(cublas), lambda i: native_linear("cublas_block", x, *cublas[i], "dynamic_group",
                                                              (128, 128), None, None)),
        "fp8_rowwise_scaled_mm": (len(per_row), lambda i: native_linear("scaled_mm", x, *per_row[i],
                                                                        "dynamic_token", None, None, None)),
    }


def _rows(layer: str, n: int, k: int, gen: torch.Generator, graph_us) -> list[dict]:
    from keel_quantization import fp8_math
    from keel_quantization.fp8_native import choose_native, native_scale

    copies = max(2, -(-(256 << 20) // (n * k)))  # > 256 MiB of fp8 weights per replay: never from L2
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
    q_row, s_row = fp8_math.quantize_per_row(w)
    q_blk, s_blk = fp8_math.quantize_blocks(w, (128, 128))
    choice = choose_native(q_blk, "dynamic_group", (128, 128), torch.bfloat16)
    per_row = [(q_row.clone(), s_row.clone()) for _ in range(copies)]
    block = [(q_blk.clone(), s_blk.clone()) for _ in range(copies)]
    cublas = [(q, native_scale("cublas_block", s)) for q, s in block]
    dense = [w.clone() for _ in range(max(2, copies // 2))]
    rows = []
    for m in MS:
        x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        row = {"layer": layer, "n": n, "k": k, "m": m, "choose_native": choice.path, "reason": choice.reason}
        paths = _paths(x, per_row, block, cublas, dense)
        if choice.path != "cublas_block":  # the probe or the shape said no: its reason is in the row
            del paths["cublas_block"]
        for path, (calls, fn) in paths.items():
            us = graph_us(fn, calls)
            row[f"{path}_us"] = us
            row[f"{path}_TFLOPS"] = 2 * m * n * k / us / 1e6
        for path in paths:
            row[f"{path}_vs_bf16"] = row["bf16_cublas_us"] / row[f"{path}_us"]
        if "cublas_block" in paths:
            a, b = paths["cublas_block"][1](0).float(), paths["triton_block"][1](0).float()
            row["cublas_vs_triton_max_rel"] = ((a - b).abs().max() / b.abs().max()).item()
        rows.append(row)
        print(json.dumps({kk: round(v, 3) if isinstance(v, float) else v for kk, v in row.items() if kk != "reason"}),
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/h200-block-fp8-gemm.json")
    ns = ap.parse_args()
    import triton

    from keel.bench import source_commit

    import h200_quant  # benchmarks/ is on sys.path when this script runs
    start = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for layer, (n, k) in h200_quant.GEMM_SHAPES.items():
        rows += _rows(layer, n, k, gen, h200_quant.graph_us)
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "commit": source_commit(Path(__file__).parent), "rows": rows, "wall_s": time.perf_counter() - start}
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({f"{r['layer']} M{r['m']}": {p: round(r[f"{p}_TFLOPS"]) for p in
                      ("bf16_cublas", "triton_block", "cublas_block", "fp8_rowwise_scaled_mm")
                      if f"{p}_TFLOPS" in r} for r in rows}, indent=1))


if __name__ == "__main__":
    main()
