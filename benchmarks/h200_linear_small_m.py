"""Sweep kernels-triton's small-M linear GEMV against F.linear (cuBLAS) at decode sizes; write the plans it wins.

    python benchmarks/h200_linear_small_m.py --out-dir DIR [--budget-s 120] [--layers 32]
    python benchmarks/h200_linear_small_m.py --smoke --out-dir DIR     # CPU, interpreted, tiny shapes

Shapes: the unquantized projections of a decode step, Llama-3-8B (qkv, o, gate_up, down) and
DeepSeek-V2-Lite (fused q + kv_a, o, layer 0's dense gate_up / down). Per shape, each candidate plan
(rows per program, inputs per step, K slices, warps) is timed at M = 1 as a CUDA graph of `--layers`
launches over distinct weights (the set larger than L2, as a step's layers are), median of 5 replays,
against F.linear the same way; the best plan is then timed at M = 2, 4, 8. A shape gets a plan when it beats
F.linear by 3% or more at M = 1; its max_m is the largest M up to which it keeps winning. The plans go to
DIR/<device>.json in `keel_kernels_triton.linear_small_m`'s format (the engine reads DIR first when
KEEL_LINEAR_SMALL_M_CONFIG_DIR=DIR; committed, they go in the package's linear_configs/), all timings to
DIR/h200-linear-small-m.json, with each path's bandwidth against a measured copy.

Prediction (before any GPU run): on the H200, DeepSeek-V2-Lite's 2-15 MB projections at M = 1 take ~5.5-6
us under cuBLAS (h200-step-profile-dsv2lite-nopdl-2bcda9d.json, ~1.4 TB/s); a GEMV with 128-256 programs
streaming them should take ~3.5-4.5 us (2.5-3.5 TB/s): -2 us a GEMM, ~-0.15 ms of a batch-1 step (2-3 GEMMs
in each of 27 layers). Llama-8B's o_proj and down_proj (cuBLAS split-K + reduce, ~84% of copy bandwidth)
maybe -5-10%; its qkv and gate_up (~96%) no plan.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
SHAPES = {  # name: (N, K); DeepSeek first: its batch-1 target is the nearer one (a budget cut drops the last)
    "dsv2lite.fused_qkv_a": (3648, 2048), "dsv2lite.o": (2048, 2048), "dsv2lite.dense_gate_up": (21888, 2048),
    "dsv2lite.dense_down": (2048, 10944), "llama8b.o": (4096, 4096), "llama8b.down": (4096, 14336),
    "llama8b.qkv": (6144, 4096), "llama8b.gate_up": (28672, 4096),
}
MS = (1, 2, 4, 8)
WIN = 0.97  # a plan must take at most this fraction of F.linear's time


def candidates(n: int, k: int, smoke: bool) -> list[dict]:
    if smoke:
        return [{"block_n": 8, "block_k": 32, "splits": s, "num_warps": 4} for s in (1, 2)]
    out = []
    # HBM wants ~32 KB in flight per SM (bandwidth x latency / SMs): wide tiles, or several programs an SM
    for bn, bk, splits, warps, ahead in itertools.product((4, 8, 16, 32), (256, 512), (1, 2, 4, 8), (4, 8),
                                                          (False, True)):
        programs = -(-n // bn) * splits
        if splits > 1 and (k // splits < 512 or programs > 4096):
            continue  # a slice of under 512 inputs, or far more programs than the SMs hold at once
        if ahead and (splits > 2 or bn * bk > 8192):
            continue  # a tile ahead doubles the registers it holds: long slices of moderate tiles only
        out.append({"block_n": bn, "block_k": bk, "splits": splits, "num_warps": warps, "ahead": ahead})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=120.0)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    from keel_kernels_triton import linear_small_m as L

    args.out_dir.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.smoke else "cuda"
    shapes = {"tiny": (40, 96)} if args.smoke else SHAPES
    dtype = torch.bfloat16
    import h200_moe_tiles as tiles

    timer = tiles.wall_ms_per_layer if args.smoke else tiles.graph_ms_per_layer
    if args.smoke:
        device_name, bw = "cpu", None
    else:
        device_name, bw = torch.cuda.get_device_name(), tiles.copy_bandwidth_GBps()
        print(f"{device_name}: copy bandwidth {bw:.0f} GB/s", flush=True)
    layers = 2 if args.smoke else args.layers
    t0 = time.perf_counter()
    rows, plans = [], {}
    for name, (n, k) in shapes.items():
        # distinct weights per launch, together past L2 (a step's layers do not hit in it)
        copies = max(1, min(layers, -(-(256 << 20) // (n * k * 2)))) if not args.smoke else 1
        ws = [torch.randn(n, k, device=device, dtype=dtype) / k**0.5 for _ in range(copies)]
        xs = {m: [torch.randn(m, k, device=device, dtype=dtype) for _ in range(layers)] for m in MS}
        ref_us = {m: timer(lambda i, m=m: F.linear(xs[m][i], ws[i % copies]), layers) * 1e3 for m in MS}
        row = {"shape": name, "n": n, "k": k, "mbytes": n * k * 2 / 1e6, "cublas_us": ref_us, "plans": []}
        best = None
        for c in candidates(n, k, args.smoke):
            if time.perf_counter() - t0 > args.budget_s:
                row["cut_by_budget"] = True
                break
            plan = L.LinearPlan(max_m=8, **c)
            try:
                got = L.linear_small_m(xs[1][0], ws[0], None, plan)
                err = ((got.float() - F.linear(xs[1][0], ws[0]).float()).abs().max()).item()
                us = timer(lambda i, plan=plan: L.linear_small_m(xs[1][i], ws[i % copies], None, plan), layers) * 1e3
            except Exception as e:  # a plan that does not compile or run: recorded, the others still run
                row["plans"].append({**c, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            row["plans"].append({**c, "us_m1": us, "max_abs_err_vs_cublas": err})
            if best is None or us < best[1]:
                best = (c, us)
        if best is not None:
            c, _ = best
            plan = L.LinearPlan(max_m=8, **c)
            gemv_us = {m: timer(lambda i, m=m: L.linear_small_m(xs[m][i], ws[i % copies], None, plan), layers) * 1e3
                       for m in MS}
            row["best"] = {**c, "us": gemv_us}
            max_m = 0
            for m in MS:
                if gemv_us[m] > WIN * ref_us[m]:
                    break
                max_m = m
            if max_m:
                plans[f"{n},{k}"] = {**c, "max_m": max_m}
            line = "  ".join(f"M={m} {gemv_us[m]:6.1f} vs {ref_us[m]:6.1f}" for m in MS)
            print(f"{name:24s} {n}x{k}: best {c}  {line}  -> max_m {max_m}", flush=True)
        if bw:
            row["cublas_GBps_m1"] = n * k * 2 / (ref_us[1] * 1e-6) / 1e9
            if best is not None:
                row["gemv_GBps_m1"] = n * k * 2 / (row["best"]["us"][1] * 1e-6) / 1e9
        rows.append(row)
        del ws, xs
    table = args.out_dir / L.device_file_name(device_name)
    table.write_text(json.dumps({"bfloat16": plans}, indent=1) + "\n")
    result = {"device": device_name, "copy_bw_GBps": bw, "commit": os.environ.get("KEEL_COMMIT", ""),
              "layers": layers, "versions": {"torch": torch.__version__}, "win_threshold": WIN,
              "plans_written": plans, "results": rows}
    (args.out_dir / "h200-linear-small-m.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"plans for {len(plans)} of {len(shapes)} shapes -> {table}", flush=True)


if __name__ == "__main__":
    main()
