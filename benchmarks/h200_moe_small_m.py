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

    python benchmarks/h200_moe_small_m.py --fp8 [--out results.json] [--layers 8]        (~40 s)
    python benchmarks/h200_moe_small_m.py --fp8-sweep [--out DIR] [--layers 8]          (~2-4 min)

`--fp8`: block-FP8 experts (e4m3 weights, 128 x 128 block scales; DeepSeek-V3's layout) on the same shapes
at M = 1, 8, 64, 256 and 8192 tokens (FP8_TOKENS), against bf16 experts holding the dequantized weights:
  bf16         the bf16 path with the engine's tiles
  fp8          what the engine runs (tiles looked up for fp8, fitted by fp8_block_tiles; the rule's a_quant:
               weight-only up to 256 tokens, W8A8 with a separate activation-quantization launch above)
  fp8_<a>      the same tiles with the activations entering another way ("none" weight-only, "load"
               W8A8 quantized in the A load, "launch"), where the tiles allow it (W8A8: dot tiles only)
Printed and written per variant: ms per layer, GB/s of expert weights read (and % of copy bandwidth),
TFLOP/s (2 x tokens x top_k x 3 x H x I), speedup over bf16, largest deviation from bf16's output.
`--fp8-sweep`: per token count 1 .. 8192 every candidate tile pair for fp8 experts (the shipped bf16
entries of every token count, fitted, each way the activations can enter; block_m pruned by size; at 1-2
tokens also gemv tiles 16-64 wide, with and without TMA), whole MoE calls timed as above; writes the fastest per token count as the fp8 tile
files (`E=64,N=..,K=..,device_name=<gpu>,dtype=fp8_w8a8,block_shape=[128,128].json`) into
kernels-triton's configs/ and --out, where the engine's fp8 lookup finds them before the bf16 files.

fp8 prediction (written before any device run): the weight bytes halve and the fp8 path now has the bf16
path's gemv / TMA / split-K machinery, so at M = 1 (gemv, 6 experts, ~52 MB) ~0.75x bf16's time (launch
and tail costs do not halve), at M = 64-256 (every expert, bandwidth-bound) ~0.55-0.6x, at 8192 W8A8 with
fp8 MMA ~0.7x bf16 (the separate quant launch costs ~5%); "load" slower than "launch" at 8192 (the A tile
re-quantized per N-block, as the fused silu showed) and within ~10% of weight-only at 64-256.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import time
from pathlib import Path

import torch
from keel_kernels_triton.fused_moe import grouped_gemm
from keel_kernels_triton.fused_moe import tile_config as tc
from keel_kernels_triton.fused_moe.grouped_gemm import fused_experts_triton
from keel_kernels_triton.fused_moe.tile_config import A_QUANTS, MoETileConfig, fp8_block_tiles, get_moe_tile_configs

from keel.layers.fp8_utils import FP8
from keel.layers.fused_moe.quant_config import FusedMoEQuantConfig

E, HIDDEN, INTER, TOP_K = 64, 2048, 1408, 6
TOKENS = [1, 2, 4, 8, 16]
FP8_TOKENS = [1, 8, 64, 256, 8192]
FP8_BLOCK = (128, 128)
SWEEP_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
GEMMS = {"w13": (2 * INTER, HIDDEN), "w2": (HIDDEN, INTER)}  # name -> (N, K)


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


def fp8_variants(tokens: int) -> dict[str, tuple]:
    """--fp8: name -> ((w13 tiles, w2 tiles), whether the experts are fp8)."""
    shapes = ((E, 2 * INTER, HIDDEN), (E, HIDDEN, INTER), TOP_K, torch.bfloat16, torch.device("cuda"), False)
    rule = get_moe_tile_configs(tokens, *shapes, fp8_block=FP8_BLOCK)
    found = {"bf16": (get_moe_tile_configs(tokens, *shapes), False), "fp8": (rule, True)}
    for a_quant in A_QUANTS:
        if a_quant != rule[0].a_quant and (a_quant == "none" or rule[0].kernel == "dot"):
            found[f"fp8_{a_quant}"] = (tuple(fp8_block_tiles(dataclasses.replace(c, a_quant=a_quant), tokens,
                                                             FP8_BLOCK[1]) for c in rule), True)
    return found


class Fp8Layer:
    """One layer's experts in e4m3 with random 128 x 128 block scales, and bf16 experts holding the same
    dequantized weights (so outputs compare)."""

    def __init__(self, quantizer) -> None:
        def experts(n: int, k: int, std: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            q = (torch.randn(E, n, k, device="cuda") * 64).clamp(-448, 448).to(FP8)
            s = torch.rand(E, n // 128, -(-k // 128), device="cuda") * (std / 32) + std / 128
            full = s.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :n, :k]
            return q, s, (q.float() * full).bfloat16()

        self.q13, s13, self.w13 = experts(2 * INTER, HIDDEN, 0.02)
        self.q2, s2, self.w2 = experts(HIDDEN, INTER, 0.03)
        self.quant = FusedMoEQuantConfig("fp8_block", s13, s2, block_shape=FP8_BLOCK, quantize_input=quantizer)

    def call(self, inp: dict, tiles, fp8: bool) -> torch.Tensor:
        if fp8:
            return fused_experts_triton(inp["x"], self.q13, self.q2, inp["w"], inp["ids"], "silu", inp["res"],
                                        tile_configs=tiles, fp8=self.quant)
        return fused_experts_triton(inp["x"], self.w13, self.w2, inp["w"], inp["ids"], "silu", inp["res"],
                                    tile_configs=tiles)


def moe_inputs(tokens: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.rand(tokens, E, device="cuda", generator=gen).topk(TOP_K, dim=1).indices.to(torch.int32)
    return {"ids": ids, "w": torch.rand(tokens, TOP_K, device="cuda", generator=gen),
            "x": torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16(),
            "res": torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16(),
            "used": int(torch.unique(ids).numel())}


def fp8_entry(ms: float, tokens: int, used: int, fp8: bool, bw: float) -> dict:
    """Figures of one timed call: weight bytes (and block scales) per second, tensor FLOP/s."""
    nbytes = used * 3 * HIDDEN * INTER * (1 if fp8 else 2)
    if fp8:
        nbytes += used * 4 * ((2 * INTER // 128) * (HIDDEN // 128) + (HIDDEN // 128) * -(-INTER // 128))
    flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
    return {"ms": ms, "GBps": nbytes / (ms * 1e-3) / 1e9, "bw_frac": nbytes / (ms * 1e-3) / (bw * 1e9),
            "TFLOPps": flops / (ms * 1e-3) / 1e12, "weight_bytes": nbytes}


def fp8_layers(count: int) -> list[Fp8Layer]:
    from keel_quantization.fp8_quant_triton import quant_fp8  # what the method hands the kernel on a GPU

    torch.manual_seed(0)
    return [Fp8Layer(quant_fp8) for _ in range(count)]


def time_call(layers: list[Fp8Layer], inp: dict, tiles, fp8: bool, tokens: int, sweep) -> tuple[float, torch.Tensor]:
    out = layers[0].call(inp, tiles, fp8).clone()  # compiles outside the capture
    n = len(layers) if tokens <= 1024 else min(len(layers), 2)  # prefill sizes: bounded memory
    return sweep.graph_ms_per_layer(lambda i: layers[i].call(inp, tiles, fp8), n, reps=7), out


def fp8_main(args, sweep, bw: float, device: str) -> None:
    layers = fp8_layers(args.layers)
    results = []
    for tokens in FP8_TOKENS:
        inp = moe_inputs(tokens)
        row = {"tokens": tokens, "experts_used": inp["used"], "variants": {}}
        found = sweep.timed_variants(f"M={tokens:5d}", fp8_variants(tokens), lambda v: time_call(
            layers, inp, v[0], v[1], tokens, sweep), row)
        for name, (tiles, fp8), ms, _, dev in found:
            entry = fp8_entry(ms, tokens, inp["used"], fp8, bw)
            base = row["variants"].get("bf16", {}).get("ms", ms)
            entry.update(speedup_vs_bf16=base / ms, max_rel_dev_vs_bf16=dev, tiles=[t.to_json() for t in tiles])
            row["variants"][name] = entry
            print(f"M={tokens:5d} {name:11s} {ms:.4f} ms/layer  {entry['GBps']:6.0f} GB/s ({entry['bw_frac']:4.0%})  "
                  f"{entry['TFLOPps']:6.1f} TFLOP/s  {base / ms:.2f}x bf16  dev {entry['max_rel_dev_vs_bf16']:.1e}  "
                  f"tiles {[t.to_json() for t in tiles]}", flush=True)
        results.append(row)
    if args.out is not None:
        summary = {"device": device, "copy_bw_GBps": bw, "layers": args.layers, "block": FP8_BLOCK, "shape": {
            "experts": E, "hidden": HIDDEN, "moe_intermediate": INTER, "top_k": TOP_K}, "results": results}
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.out}")


def sweep_candidates(tokens: int, device: str) -> list[tuple]:
    """--fp8-sweep: (w13, w2) fp8 tile pairs for `tokens`: every shipped bf16 pair (one block_m per pair, as
    the files hold), fitted to fp8 with each way the activations can enter; block_m pruned by size."""
    files = [tc.read_tile_config_file(tc.CONFIG_DIR / tc.config_file_name(E, n, k, device)) for n, k in GEMMS.values()]
    pairs = set()
    for m in set(files[0]) & set(files[1]):
        c13, c2 = (dataclasses.replace(f[m], split_k=f[m].split_k or 1, a_quant=None) for f in files)
        fits = c13.block_m <= 16 if tokens <= 16 else 16 <= c13.block_m <= 64 if tokens <= 256 else c13.block_m >= 64
        if c13.block_m != c2.block_m or not fits:
            continue
        for a_quant in A_QUANTS:
            if a_quant == "none" or c13.kernel == "dot":
                pairs.add(tuple(fp8_block_tiles(dataclasses.replace(c, a_quant=a_quant), tokens, FP8_BLOCK[1])
                                for c in (c13, c2)))
    if tokens <= 2:  # e4m3 tiles carry half the bytes of a bf16 tile of the same shape: wider gemv tiles too
        for block_n in (16, 32, 64):
            for tma in (False, True):
                gemv = MoETileConfig(1, block_n, 128, 4, 3, kernel="gemv", weight_tma=tma, a_quant="none")
                pairs.add((gemv, gemv))
    return sorted(pairs, key=str)


def fp8_sweep_main(args, sweep, bw: float, device: str) -> None:
    start = time.perf_counter()
    layers = fp8_layers(args.layers)
    best: dict[int, tuple] = {}
    results = []
    for tokens in SWEEP_TOKENS:
        inp = moe_inputs(tokens)
        timed = []
        for tiles in sweep_candidates(tokens, device):
            try:
                ms, _ = time_call(layers, inp, tiles, True, tokens, sweep)
            except Exception as e:  # noqa: BLE001 - a failing candidate is skipped
                sweep.variant_failed(f"M={tokens:5d} {[t.to_json() for t in tiles]}", e)
                continue
            timed.append((ms, tiles))
        if not timed:
            continue
        ms, tiles = min(timed, key=lambda t: t[0])
        best[tokens] = tiles
        entry = fp8_entry(ms, tokens, inp["used"], True, bw)
        results.append({"tokens": tokens, "best": [t.to_json() for t in tiles], **entry, "candidates": [
            {"ms": m, "tiles": [t.to_json() for t in c]} for m, c in timed]})
        print(f"M={tokens:5d} best {ms:.4f} ms/layer ({entry['bw_frac']:4.0%} of copy bw, {entry['TFLOPps']:.1f} "
              f"TFLOP/s) of {len(timed)}: {[t.to_json() for t in tiles]}  [{time.perf_counter() - start:.0f} s]",
              flush=True)
    suffix = tc.fp8_block_file_suffix(FP8_BLOCK)
    sweep.store_tile_files({tc.config_file_name(E, n, k, device, suffix): {m: tiles[i] for m, tiles in best.items()}
                            for i, (n, k) in enumerate(GEMMS.values())}, args.out)
    if args.out is not None:
        (args.out / "h200-moe-fp8-sweep.json").write_text(json.dumps(
            {"device": device, "copy_bw_GBps": bw, "layers": args.layers, "results": results,
             "elapsed_s": time.perf_counter() - start}, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    ap.add_argument("--layers", type=int, default=8, help="distinct weight copies per timed graph")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--fp8", action="store_true", help="block-FP8 experts vs bf16 at FP8_TOKENS")
    mode.add_argument("--fp8-sweep", action="store_true", help="tune the fp8 experts' tiles; --out is a folder")
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    sweep = _tiles_bench()
    bw = sweep.copy_bandwidth_GBps()
    print(f"{device}: copy bandwidth {bw:.0f} GB/s")
    if args.fp8 or args.fp8_sweep:
        (fp8_main if args.fp8 else fp8_sweep_main)(args, sweep, bw, device)
        return
    w13 = [torch.empty(E, 2 * INTER, HIDDEN, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02)
           for _ in range(args.layers)]
    w2 = [torch.empty(E, HIDDEN, INTER, dtype=torch.bfloat16, device="cuda").normal_(0, 0.03)
          for _ in range(args.layers)]
    results = []
    for tokens in TOKENS:
        inp = moe_inputs(tokens)
        used = inp["used"]
        nbytes = used * 3 * HIDDEN * INTER * 2  # w13 (2 * I x H) and w2 (H x I) of every routed expert
        row = {"tokens": tokens, "experts_used": used, "expert_bytes": nbytes, "variants": {}}
        found = sweep.timed_variants(f"M={tokens:2d}", variants(tokens), lambda v: time_variant(
            v[0], v[1], inp, w13, w2, sweep), row)
        for name, (tiles, bounded), ms, _, err in found:
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
