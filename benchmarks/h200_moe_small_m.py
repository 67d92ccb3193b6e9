"""The fused MoE at decode sizes on this GPU: the grouped GEMMs as on main vs the small-M (split-K) path.

    python benchmarks/h200_moe_small_m.py [--out results.json] [--layers 8]

DeepSeek-V2-Lite shapes (64 experts, hidden 2048, moe_intermediate 1408, top-6, bf16). For M = 1, 2, 4, 8,
16 tokens each variant runs the whole `fused_experts_triton` call (alignment, w13 GEMM, w2 GEMM with the
fused silu-and-mul in its A load, top-k combine with the shared experts' residual) over `--layers`
distinct weight copies inside one CUDA graph; per-layer time = median replay / layers. Printed per
variant: ms per layer, % of copy bandwidth (bytes of the routed experts' weights read / time / measured
copy bandwidth), speedup over `main`, and the largest deviation from `main`'s output.

Variants (tiles: the tuned file's entry for M, else the built-in default):
  main        split_k 1, every padded block launched (61 M-blocks at M=1, of which 6 hold a row)
  bounded     split_k 1, M-blocks limited to those that can hold rows (`live_block_bound`)
  small_m     what the engine now runs: the small-M rule (split_k 4 for both GEMMs at M <= 16)
  split2/8    the small-M path with 2 or 8 K slices; split4_n32: 4 slices, block_n 32

Prediction (written before any device run): at M=1 `main` streams ~104 MB per layer at ~44% of copy
bandwidth; most of its 2,684 + 1,952 programs exit at once but still cost a launch slot each. `bounded`
keeps the 264 + 192 live programs (~1.2x); splitting K four ways gives ~1,800 programs with short K
loops, about 3 waves on 132 SMs with far more loads in flight: `small_m` ~70% of copy bandwidth, ~1.5x
over `main` at M=1, ~1.35x at M=2-4, ~1.2x at M=8, ~1.1x at M=16 (experts get 1-2 rows, the GEMMs are
already near 80% there and the float32 partials start to cost). The lead records the outcome beside this.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
from pathlib import Path

import torch
from keel_kernels_triton.fused_moe import grouped_gemm
from keel_kernels_triton.fused_moe.grouped_gemm import fused_experts_triton
from keel_kernels_triton.fused_moe.tile_config import get_moe_tile_configs

E, HIDDEN, INTER, TOP_K = 64, 2048, 1408, 6
TOKENS = [1, 2, 4, 8, 16]


def _tiles_bench():
    # the tile sweep's copy-bandwidth probe and graph timing (same directory; scripts are not a package)
    path = Path(__file__).resolve().parent / "h200_moe_tiles.py"
    spec = importlib.util.spec_from_file_location("h200_moe_tiles", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def variants(tokens: int) -> dict[str, tuple]:
    """name -> ((w13 tiles, w2 tiles), whether the M grid is bounded)."""
    c13, c2 = get_moe_tile_configs(tokens, (E, 2 * INTER, HIDDEN), (E, HIDDEN, INTER), TOP_K, torch.bfloat16,
                                   torch.device("cuda"), False)

    def split(k: int, **kw):
        if k > 1:  # the activation epilogue takes one K slice (MoETileConfig rejects it with a split)
            kw["act_epilogue"] = False
        return dataclasses.replace(c13, split_k=k, **kw), dataclasses.replace(c2, split_k=k, **kw)

    return {
        "main": (split(1), False),
        "bounded": (split(1), True),
        "small_m": ((c13, c2), True),
        "split2": (split(2), True),
        "split8": (split(8), True),
        "split4_n32": (split(4, block_n=32), True),
    }


def time_variant(tiles, bounded: bool, inp: dict, w13: list, w2: list, sweep) -> tuple[float, torch.Tensor]:
    def step(layer: int) -> torch.Tensor:
        return fused_experts_triton(inp["x"], w13[layer], w2[layer], inp["w"], inp["ids"], "silu", inp["res"],
                                    tile_configs=tiles)

    real_bound = grouped_gemm.live_block_bound
    if not bounded:  # main's grid: every block of the padded buffer (the launch shape is fixed at capture)
        grouped_gemm.live_block_bound = lambda pairs, experts, block_m: 1 << 30
    try:
        out = step(0)  # compiles outside the capture
        return sweep.graph_ms_per_layer(step, len(w13), reps=7), out.clone()
    finally:
        grouped_gemm.live_block_bound = real_bound


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    ap.add_argument("--layers", type=int, default=8, help="distinct weight copies per timed graph")
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    sweep = _tiles_bench()
    bw = sweep.copy_bandwidth_GBps()
    print(f"{device}: copy bandwidth {bw:.0f} GB/s")
    w13 = [torch.empty(E, 2 * INTER, HIDDEN, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02)
           for _ in range(args.layers)]
    w2 = [torch.empty(E, HIDDEN, INTER, dtype=torch.bfloat16, device="cuda").normal_(0, 0.03)
          for _ in range(args.layers)]
    results = []
    for tokens in TOKENS:
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        ids = torch.rand(tokens, E, device="cuda", generator=gen).topk(TOP_K, dim=1).indices.to(torch.int32)
        inp = {"ids": ids, "w": torch.rand(tokens, TOP_K, device="cuda", generator=gen),
               "x": torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16(),
               "res": torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()}
        used = int(torch.unique(ids).numel())
        nbytes = used * 3 * HIDDEN * INTER * 2  # w13 (2 * I x H) and w2 (H x I) of every routed expert
        row = {"tokens": tokens, "experts_used": used, "expert_bytes": nbytes, "variants": {}}
        ref = None
        for name, (tiles, bounded) in variants(tokens).items():
            try:
                ms, out = time_variant(tiles, bounded, inp, w13, w2, sweep)
            except Exception as e:  # noqa: BLE001 - a failing variant is reported, the rest still run
                row["variants"][name] = sweep.variant_failed(f"M={tokens:2d} {name:11s}", e)
                continue
            ref = out if ref is None else ref
            err = sweep.max_rel_dev(out, ref)
            main_ms = row["variants"].get("main", {}).get("ms", ms)
            entry = {"ms": ms, "bw_frac": nbytes / (ms * 1e-3) / (bw * 1e9), "speedup_vs_main": main_ms / ms,
                     "max_rel_dev_vs_main": err, "tiles": [t.to_json() for t in tiles], "bounded_grid": bounded}
            row["variants"][name] = entry
            print(f"M={tokens:2d} {name:11s} {ms:.4f} ms/layer  {entry['bw_frac']:5.1%} of copy bw  "
                  f"{entry['speedup_vs_main']:.2f}x vs main  dev {err:.1e}  splits {[t.split_k for t in tiles]}")
        results.append(row)
    if args.out is not None:
        summary = {"device": device, "copy_bw_GBps": bw, "layers": args.layers, "shape": {
            "experts": E, "hidden": HIDDEN, "moe_intermediate": INTER, "top_k": TOP_K}, "results": results}
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
