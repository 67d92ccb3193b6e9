"""Mid-size int4 GEMMs (GPTQ / AWQ, group 128 in order) at Llama-3-8B's layer shapes: the swapped-operand
tensor-core GEMM (`int4_mma_triton`, a few tiles) against what keel runs today -- the in-register tile GEMM's
shipped plan below `int4_linear.DEQUANT_GEMM_MIN_M` (256) and the full dequantize + cuBLAS from it -- and bf16
cuBLAS on a ready weight; per M the four layers' total, and the largest difference of each tile's output from
the dequantize + cuBLAS output (the same bf16 weights: only the summation order differs).

    python benchmarks/h200_int4_mma.py --out benchmarks/results/h200-int4-mma.json
        (plans per layer shape and M, a tile where it beats the path a null entry keeps -- the tile GEMM below
        DEQUANT_GEMM_MIN_M, dequantize + cuBLAS from it -- by 3%+: int4-mma/<device>.json beside --out, or
        --plans-dir: `int4_mma_plans`' file for this device, to commit with the result)

Why, predictions and outcomes: int4_mma_triton's docstring and the comments on TILES below. Timing: CUDA-graph
replays cycling through weight copies past the L2 (h200_quant.graph_us), as decode steps run. Until 0b309ac each
call was timed alone with CUDA events around it (h200_llama8b._events_ms), which counts the host's launch: at 8-32
tokens (a few to ~60 us of GPU a layer) that measured launches -- one for a split-1 tile, two for the small-M
path's split-K GEMM and its reduce -- not kernels, and the 8-32-token plans it wrote were withdrawn.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

_here = Path(__file__).resolve().parent
MS = (8, 16, 32, 64, 128, 256, 512)
# (BLOCK_N weight rows, BLOCK_M tokens, num_warps, num_stages[, split_k]); BLOCK_K 128 (the scale group)
# sm_90 SASS (benchmarks/sass_mix.py --mma): a thread issues ~490-540 instructions a K tile whatever the tile, so
# the token tile sets the dequantize's share: 128 x 256 (8 warps) issues ~1040 clocks a tile per scheduler against
# ~2050 of MMA, 128 x 128 ~970 against ~1020, 64 x 64 ~440 against ~260 (64 x 256 at 4 warps spills a little)
# Split K: at 415397c (h100-int4-mma-415397c.json, M = 256) the layers with few tiles ran at 106-193 TFLOP/s (o:
# 64 x 2 programs on 132 SMs, qkv 96 x 2, down 64 x 2) and gate_up (448 x 2) at 289, so the programs, not the
# tile, were short: split 2-4 gives those layers 256-512. Predicted at M = 256: qkv 91 -> ~60 us, o 81 -> ~50,
# down 156 -> ~95 (four layers 518 -> ~400); at M = 128 (one token tile: 64-96 programs) 413 -> ~290.
# Token tiles of 16 / 32 for steps of 8-48 tokens (moderate concurrency; today the tile GEMM serves them, with
# the tokens as its MMA's M, padded to 16 rows): an MMA's N may be 8-256, and at such M the weight's bytes and
# the dequantize's issue, not the MMA, set the pace -- split K for programs. Prediction (before any run,
# sass_mix: 401 / 440 instructions a K tile for 64 x 16 / 64 x 32): four layers at M = 16 on the H100 ~60-80 us
# (gate_up ~25-30: ~24 us of issue, ~20 of bytes) against ~140 for the tile GEMM's dot plans.
TILES = [(128, 256, 8, 2), (128, 256, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (64, 128, 4, 3), (64, 256, 4, 2),
         (64, 64, 4, 4), (64, 128, 4, 3, 2), (64, 128, 4, 3, 4), (64, 64, 4, 4, 2), (64, 64, 4, 4, 4),
         (128, 128, 8, 3, 2), (64, 32, 4, 4), (64, 32, 4, 4, 2), (64, 16, 4, 4), (64, 16, 4, 4, 4),
         (128, 32, 8, 4, 2)]
# The same tiles with the pairs dequantize (MmaTile.pairs: neighbouring inputs one register; the same numbers).
# Prediction (before any run; sm_90 SASS 12-15% fewer instructions a K tile from 32 tokens, +8% at 16): -5 to -10%
# a layer where the tile wins today, nothing at 16 tokens. Measured at 0b309ac: it won most shapes and sizes.
# Since its tile is built with the pair index as an axis (no layout conversion through shared memory, 2 CTA
# barriers a K tile instead of 5; int4_mma_triton's docstring) every tile is also swept in the pairs form.
# Prediction: M 128-512 -10 to -25% a layer against the joined pairs form, M 8-32 -5 to -10%.
TILES += [t[:4] + (t[4] if len(t) > 4 else 1, True) for t in TILES]


WIN = 0.97  # a tile is written where its time is under this fraction of the time of the path it replaces


def _tiles(tile_cls) -> list:
    """(label, tile) per TILES entry."""
    def label(bn, bm, warps, stages, split=1, pairs=False):
        return f"mma {bn}x{bm} w{warps} s{stages}" + (f" k{split}" if split > 1 else "") + (" p" if pairs else "")

    return [(label(*t), tile_cls(t[0], t[1], 128, *t[2:])) for t in TILES]


def plan_rows(rows: list[dict], tiles: dict, dequant_min_m: int) -> list[dict]:
    """int4_mma_configs rows, one per measured (layer shape, M): the best tile where it beats the path a null
    entry keeps (the tile GEMM below `dequant_min_m`, dequantize + cuBLAS from it) by WIN, else null."""
    import dataclasses

    out = []
    for r in sorted(rows, key=lambda r: (r["n"], r["k"], r["m"])):
        us = r["us"]
        today = us.get("shipped_tile_gemm" if r["m"] < dequant_min_m else "dequant_cublas", float("inf"))
        mma = [(t, lb) for lb, t in us.items() if lb in tiles]
        best = min(mma) if mma else None
        win = best is not None and best[0] < WIN * today
        out.append({"m": int(r["m"]), "n": int(r["n"]), "k": int(r["k"]),
                    "tile": dataclasses.asdict(tiles[best[1]]) if win else None})
    return out


def _sibling(name: str):
    from keel.testing.scripts import load_script

    return load_script(_here / f"{name}.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/h200-int4-mma.json")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--budget-s", type=float, default=120.0)
    ap.add_argument("--plans-dir", default=None, help="where to write this device's int4_mma_configs file "
                    "(default: beside --out, in int4-mma/)")
    ns = ap.parse_args()
    import triton

    from keel.bench import source_commit
    from keel_quantization.int4_dequant_triton import int4_dequantize
    from keel_quantization.int4_mma_plans import MmaTile
    from keel_quantization.int4_mma_triton import int4_mma_gemm
    from keel_quantization.int4_triton import int4_gemm

    prefill = _sibling("h200_int4_prefill")
    gen = torch.Generator(device="cuda").manual_seed(0)
    # per layer, copies of its int4 weight (qweight, scales, zeros, g_idx) past 256 MiB together: a timing cycles
    # through them, so each replay reads its weight from memory, not the L2 (the small-M sweep's own copies)
    small_m = _sibling("h200_quant_small_m")  # load_script executes the file: once, not per layer
    copies = {name: small_m._weights("int4_g128", n, k, gen)[0] for name, (n, k) in prefill.SHAPES.items()}
    tiles = _tiles(MmaTile)  # (label, tile)
    quant = _sibling("h200_quant")
    # per layer, its bf16 weight [K, N] dequantized (bf16 cuBLAS's operand, the reference) and copies past the L2
    dense = {name: quant.past_l2(int4_dequantize(*w[0], torch.bfloat16, 128)) for name, w in copies.items()}
    t0 = time.perf_counter()
    rows = []
    for m in (int(v) for v in ns.ms.split(",")):
        for name, (n, k) in prefill.SHAPES.items():
            w = copies[name]  # [(qweight, scales, zeros, g_idx)]
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            ref = (x @ dense[name][0]).float()
            fns = {"dequant_cublas": (len(w), lambda i: x @ int4_dequantize(*w[i], torch.bfloat16, 128)),
                   "shipped_tile_gemm": (len(w), lambda i: int4_gemm(x, *w[i], group_size=128)),
                   "bf16_cublas": (len(dense[name]), lambda i: x @ dense[name][i])}
            for label, tile in tiles:
                fns[label] = (len(w), lambda i, tile=tile: int4_mma_gemm(x, *w[i][:3], 128, tile=tile))
            first_label, first = tiles[0]  # the float32 dequantize, for its cost against the 16-bit one
            fns["float32 dequantize " + first_label] = (len(w), lambda i: int4_mma_gemm(x, *w[i][:3], 128,
                                                                                        tile=first, magic16=False))
            row = {"m": m, "layer": name, "n": n, "k": k, "us": {}, "max_rel_diff": {}}
            quant.time_paths(row, fns, ref, "mma", lambda: time.perf_counter() - t0 > ns.budget_s)
            rows.append(row)
            print(json.dumps({k_: row[k_] for k_ in ("m", "layer", "us")}, default=lambda v: round(v, 1)), flush=True)
    totals = quant.totals_per_m(rows, len(prefill.SHAPES))
    best = {m: min((us, lb) for lb, us in t.items() if lb.startswith("mma")) if any(lb.startswith("mma") for lb in t)
            else None for m, t in totals.items()}
    from keel_quantization.int4_linear import DEQUANT_GEMM_MIN_M

    plans = plan_rows(rows, dict(tiles), DEQUANT_GEMM_MIN_M)
    plans_dir = Path(ns.plans_dir) if ns.plans_dir else Path(ns.out).parent / "int4-mma"
    plans_dir.mkdir(parents=True, exist_ok=True)
    from keel_quantization.int4_mma_plans import device_file_name

    (plans_dir / device_file_name(torch.cuda.get_device_name())).write_text(json.dumps({"bfloat16": plans}, indent=1))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": source_commit(_here) or "unknown", "rows": rows, "us_per_four_layers": totals,
              "best_mma_per_m": best, "plans_written": plans, "win_threshold": WIN}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=1, default=float))
    print(json.dumps({"us_per_four_layers": totals, "best_mma_per_m": best}, indent=1,
                     default=lambda v: round(v, 1)))


if __name__ == "__main__":
    main()
