"""Tune the fused MoE GEMM's tiles for DeepSeek-V2-Lite shapes on this GPU and store them where keel reads them.

    python benchmarks/h200_moe_tiles.py [--out DIR] [--budget-s 120] [--layers 8]

For E=64 experts, hidden 2048, intermediate 1408, top_k 6, bf16, both grouped GEMMs of a MoE layer
(w13: N=2816, K=2048, rows gathered from the tokens; w2: N=2048, K=1408, silu(gate) * up fused into the
A load, rows times their routing weight), at token counts 1 .. 2048, times a fixed grid of ~30 tile
configs (pruned per token count: block_m 32 from 16 tokens, 64 from 64 tokens):

  * each config is compiled once per GEMM (2 compiles per config: the cost of this script); one that
    fails to compile or launch (e.g. out of shared memory) is skipped, as is one whose output differs from
    the default config's beyond bf16 accumulation-order noise (checked once per config and GEMM);
  * timing replays a CUDA graph of `--layers` launches over distinct weight copies (a real step walks
    26 layers; distinct copies keep a launch from finding its experts in L2), median of 5 replays;
  * both GEMMs of one call share block_m (the sorted rows are padded once), so per token count the best
    w13 and w2 configs are picked per block_m and the block_m with the least summed time wins.

Tiles are swept on the one-slice path; the files leave split_k to the small-M rule (no "SPLIT_K").
Writes `E=64,N=2816,K=2048,device_name=<gpu>.json` and `E=64,N=2048,K=1408,device_name=<gpu>.json` into
kernels-triton's package folder keel_kernels_triton/fused_moe/configs/ (the repo's folder with an editable
install, so an engine started afterwards uses them), copies them and a results JSON to --out, and prints per token count
the default and best times and their bandwidth fraction (routed-expert bytes the step reads / time /
measured copy bandwidth). Token counts the time budget leaves unmeasured get the default config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
from keel_kernels_triton.fused_moe.align import moe_align_block_size
from keel_kernels_triton.fused_moe.grouped_gemm import invoke_fused_moe_kernel
from keel_kernels_triton.fused_moe.tile_config import (
    CONFIG_DIR,
    MoETileConfig,
    config_file_name,
    default_moe_tile_config,
    write_tile_config_file,
)

E, HIDDEN, INTER, TOP_K = 64, 2048, 1408, 6
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
LEGACY = MoETileConfig(16, 64, 32, 4, 3)  # the fixed tiles before tuning
GRID = [
    # block_m 16: decode, weight streaming; deep K tiles and several stages keep loads in flight
    (16, 32, 64, 4, 5), (16, 32, 128, 4, 4), (16, 32, 128, 4, 5), (16, 32, 256, 4, 3), (16, 32, 256, 4, 4),
    (16, 64, 64, 4, 4), (16, 64, 128, 4, 3), (16, 64, 128, 4, 4), (16, 64, 128, 4, 5), (16, 64, 256, 4, 3),
    (16, 64, 256, 4, 4), (16, 64, 256, 8, 3), (16, 128, 128, 4, 3), (16, 128, 128, 8, 4),
    # block_m 32
    (32, 64, 64, 4, 4), (32, 64, 128, 4, 3), (32, 64, 128, 4, 4), (32, 64, 256, 4, 3), (32, 128, 64, 4, 3),
    (32, 128, 64, 8, 4), (32, 128, 128, 8, 3),
    # block_m 64: prefill-sized steps
    (64, 64, 64, 4, 4), (64, 64, 64, 8, 4), (64, 64, 128, 4, 3), (64, 128, 64, 4, 3), (64, 128, 64, 8, 3),
    (64, 128, 64, 8, 4), (64, 128, 128, 8, 3),
    # prefill sizes: grouped program order (GROUP_SIZE_M), wider and taller tiles
    (64, 128, 64, 4, 3, 1, 8), (64, 128, 64, 8, 3, 1, 8), (64, 256, 64, 8, 3, 1, 8), (128, 128, 64, 8, 3, 1, 8),
    (128, 128, 64, 4, 3, 1, 8), (128, 128, 64, 8, 4, 1, 8), (128, 256, 64, 8, 3, 1, 8), (128, 64, 64, 4, 4, 1, 8),
    (128, 128, 64, 8, 3), (64, 128, 64, 8, 3, 1, 16),
]
GEMMS = {"w13": (2 * INTER, HIDDEN), "w2": (HIDDEN, INTER)}  # name -> (N, K)


def tc_tuned(n: int, k: int, device: str) -> dict:
    """The shipped file's entries for this GEMM on `device` (token count -> config), or {}: the file the
    engine reads, a sibling device's where this one has none (tile_config.SIBLING_DEVICES)."""
    from keel_kernels_triton.fused_moe.tile_config import _tuned

    return dict(_tuned(E, n, k, device, (CONFIG_DIR,)))


def copy_bandwidth_GBps() -> float:
    n = 1 << 30
    src = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    del src, dst
    return 2 * n / statistics.median(times) / 1e6


def default_tiles(tokens: int, n: int, k: int) -> MoETileConfig:
    """The built-in tiles on the one-slice path: the sweep tunes tiles, the small-M rule keeps deciding
    split_k (entries are written without SPLIT_K; benchmarks/h200_moe_small_m.py times the split path)."""
    return dataclasses.replace(default_moe_tile_config(tokens, E, n, k, TOP_K, torch.bfloat16), split_k=1)


def wall_ms_per_layer(launch, layers: int) -> float:
    """launch(0) .. launch(layers - 1) timed by the wall clock, ms per layer: the smoke runs' timer (CPU)."""
    start = time.perf_counter()
    for layer in range(layers):
        launch(layer)
    return (time.perf_counter() - start) * 1e3 / layers


def graph_ms_per_layer(launch, layers: int, reps: int = 5) -> float:
    """Capture launch(0) .. launch(layers - 1) in one CUDA graph; median replay ms / layers. One eager
    launch first: Triton compiles, and a process's first cuBLAS call creates its handle, which fails inside
    a capture (CUBLAS_STATUS_NOT_INITIALIZED: h200_linear_small_m.py's reference, when it ran first)."""
    launch(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            launch(layer)
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / layers)
    return statistics.median(times)


def variant_failed(label: str, exc: Exception) -> dict:
    """A variant that raised: printed after `label`, and its result entry (the other variants still run)."""
    print(f"{label} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    return {"error": f"{type(exc).__name__}: {exc}"[:400]}


def max_rel_dev(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest deviation of `out` from `ref`, relative to ref's largest magnitude."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def candidates(tokens: int) -> list[MoETileConfig]:
    cfgs = {MoETileConfig(*c) for c in GRID} | {LEGACY}
    for n, k in GEMMS.values():
        cfgs.add(default_tiles(tokens, n, k))
    keep = [c for c in cfgs if (c.block_m < 32 or tokens >= 16) and (c.block_m < 64 or tokens >= 64)
            and (c.block_m > 16 or tokens <= 1024) and (c.block_m < 128 or tokens >= 1024)
            and (c.group_m == 1 or tokens >= 512)]
    return sorted(keep, key=lambda c: (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages))


def best_pairs(per_gemm: dict[str, dict[MoETileConfig, float]]) -> list[tuple[float, MoETileConfig, MoETileConfig]]:
    """Per block_m both GEMMs ran with, (summed ms, w13 config, w2 config) of the fastest of each: one call's
    GEMMs share block_m (the sorted rows are padded once)."""
    pairs = []
    for bm in sorted({c.block_m for c in per_gemm["w13"]} & {c.block_m for c in per_gemm["w2"]}):
        c13 = min((c for c in per_gemm["w13"] if c.block_m == bm), key=per_gemm["w13"].get)
        c2 = min((c for c in per_gemm["w2"] if c.block_m == bm), key=per_gemm["w2"].get)
        pairs.append((per_gemm["w13"][c13] + per_gemm["w2"][c2], c13, c2))
    return pairs


class Bench:
    """Inputs of both GEMMs for `layers` distinct weight copies, and graph-timed launches per config."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.w13 = [torch.empty(E, 2 * INTER, HIDDEN, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02)
                    for _ in range(layers)]
        self.w2 = [torch.empty(E, HIDDEN, INTER, dtype=torch.bfloat16, device="cuda").normal_(0, 0.03)
                   for _ in range(layers)]
        self.dead: set[tuple[str, MoETileConfig]] = set()  # failed to compile/launch, or wrong output
        self.checked: set[tuple[str, MoETileConfig]] = set()

    def inputs(self, tokens: int) -> dict:
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        scores = torch.rand(tokens, E, device="cuda", generator=gen)
        ids = scores.topk(TOP_K, dim=1).indices.to(torch.int32)  # distinct experts per token
        rows = tokens * TOP_K
        return {
            "ids": ids, "experts_used": int(torch.unique(ids).numel()),
            "hidden": torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16(),
            "gate_up": torch.randn(rows, 2 * INTER, device="cuda", generator=gen).bfloat16(),
            "weights": torch.rand(rows, device="cuda", generator=gen),
            "out": {g: torch.empty(rows, n, dtype=torch.bfloat16, device="cuda") for g, (n, _) in GEMMS.items()},
            "align": {},
        }

    def launch(self, gemm: str, cfg: MoETileConfig, inp: dict, layer: int) -> None:
        if cfg.block_m not in inp["align"]:
            inp["align"][cfg.block_m] = moe_align_block_size(inp["ids"], E, cfg.block_m)
        sorted_ids, expert_ids, total = inp["align"][cfg.block_m]
        if gemm == "w13":
            invoke_fused_moe_kernel(inp["hidden"], self.w13[layer], inp["out"]["w13"], None, sorted_ids,
                                    expert_ids, total, TOP_K, cfg)
        else:
            invoke_fused_moe_kernel(inp["gate_up"], self.w2[layer], inp["out"]["w2"], inp["weights"], sorted_ids,
                                    expert_ids, total, 1, cfg, act_silu=True)

    def output(self, gemm: str, cfg: MoETileConfig, inp: dict) -> torch.Tensor:
        self.launch(gemm, cfg, inp, 0)
        torch.cuda.synchronize()
        return inp["out"][gemm].clone()

    def time_ms(self, gemm: str, cfg: MoETileConfig, inp: dict, ref: torch.Tensor | None) -> float | None:
        """Per-launch ms, or None when the config is dead for this GEMM (reason printed once)."""
        key = (gemm, cfg)
        if key in self.dead:
            return None
        try:
            if key not in self.checked and ref is not None:
                got = self.output(gemm, cfg, inp).float()
                err = (got - ref.float()).abs().max().item()
                if not err <= 2e-2 * ref.float().abs().max().item() + 1e-3:  # also catches NaN
                    raise ValueError(f"output differs from the default config's by {err:.3g}")
                self.checked.add(key)
            self.launch(gemm, cfg, inp, 0)  # compiles (once per config and GEMM) outside the capture
            return graph_ms_per_layer(lambda layer: self.launch(gemm, cfg, inp, layer), self.layers)
        except Exception as e:  # noqa: BLE001 - any failing config is skipped, not fatal
            print(f"  skip {gemm} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            self.dead.add(key)
            return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="also copy the config files and results here")
    ap.add_argument("--budget-s", type=float, default=120.0, help="stop measuring new token counts after this")
    ap.add_argument("--layers", type=int, default=8, help="distinct weight copies per timed graph")
    ap.add_argument("--tokens", default=None,
                    help="comma-separated token counts to measure; the others keep the shipped file's entries")
    args = ap.parse_args()
    only = None if args.tokens is None else {int(t) for t in args.tokens.split(",")}
    start = time.perf_counter()
    device = torch.cuda.get_device_name()
    bw = copy_bandwidth_GBps()
    print(f"{device}: copy bandwidth {bw:.0f} GB/s")
    bench = Bench(args.layers)
    best: dict[str, dict[int, MoETileConfig]] = {g: {} for g in GEMMS}
    results = []
    # decode sizes first: if the budget runs out, the large (prefill) sizes keep the default
    shipped = {g: tc_tuned(n, k, device) for g, (n, k) in GEMMS.items()}  # read before this run writes them
    for tokens in TOKENS:
        if only is not None and tokens not in only:
            for g, (n, k) in GEMMS.items():
                best[g][tokens] = shipped[g].get(tokens) or default_tiles(tokens, n, k)
            continue
        if time.perf_counter() - start > args.budget_s:
            print(f"M={tokens}: not measured (time budget); default tiles")
            for g, (n, k) in GEMMS.items():
                best[g][tokens] = default_tiles(tokens, n, k)
            continue
        inp = bench.inputs(tokens)
        per_gemm: dict[str, dict[MoETileConfig, float]] = {}
        defaults = {}
        for g, (n, k) in GEMMS.items():
            dflt = default_tiles(tokens, n, k)
            defaults[g] = dflt
            try:
                ref = bench.output(g, dflt, inp)
            except Exception as e:  # noqa: BLE001 - then configs are timed unchecked
                print(f"  default {g} {dflt} failed ({type(e).__name__}); outputs unchecked at M={tokens}")
                ref = None
            per_gemm[g] = {}
            for cfg in candidates(tokens):
                ms = bench.time_ms(g, cfg, inp, ref)
                if ms is not None:
                    per_gemm[g][cfg] = ms
        pairs = best_pairs(per_gemm)
        if not pairs:
            print(f"M={tokens}: no config ran; default tiles")
            for g in GEMMS:
                best[g][tokens] = defaults[g]
            continue
        t_best, c13, c2 = min(pairs, key=lambda p: p[0])
        best["w13"][tokens], best["w2"][tokens] = c13, c2
        expert_bytes = {g: inp["experts_used"] * n * k * 2 for g, (n, k) in GEMMS.items()}
        total_bytes = sum(expert_bytes.values())

        def frac(ms: float | None, nbytes: int = total_bytes) -> float:
            return nbytes / (ms * 1e-3) / (bw * 1e9) if ms else float("nan")

        t_dflt = sum(per_gemm[g].get(defaults[g], float("nan")) for g in GEMMS)
        t_legacy = sum(per_gemm[g].get(LEGACY, float("nan")) for g in GEMMS)
        row = {"tokens": tokens, "experts_used": inp["experts_used"], "expert_bytes": total_bytes,
               "default_ms": t_dflt, "default_bw_frac": frac(t_dflt), "legacy_ms": t_legacy,
               "legacy_bw_frac": frac(t_legacy), "best_ms": t_best, "best_bw_frac": frac(t_best),
               "best": {"w13": c13.to_json(), "w2": c2.to_json()},
               "best_per_gemm_ms": {"w13": per_gemm["w13"][c13], "w2": per_gemm["w2"][c2]},
               "configs_timed": {g: len(v) for g, v in per_gemm.items()}}
        results.append(row)
        print(f"M={tokens:5d} experts={inp['experts_used']:2d}  legacy {t_legacy:.4f} ms ({frac(t_legacy):.0%})  "
              f"default {t_dflt:.4f} ms ({frac(t_dflt):.0%})  best {t_best:.4f} ms ({frac(t_best):.0%})  "
              f"w13 {c13}  w2 {c2}   [{time.perf_counter() - start:.0f} s]")
    files = []
    for g, (n, k) in GEMMS.items():
        path = CONFIG_DIR / config_file_name(E, n, k, device)
        write_tile_config_file(path, {m: dataclasses.replace(c, split_k=c.split_k if m <= 16 else None)
                                      for m, c in best[g].items()})
        files.append(path)
        print(f"wrote {path}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for path in files:
            shutil.copy(path, args.out / path.name)
        summary = {"device": device, "copy_bw_GBps": bw, "layers": args.layers, "results": results,
                   "compiled_configs": len({c for _, c in bench.checked} | {c for _, c in bench.dead}),
                   "dead": [[g, c.to_json()] for g, c in sorted(bench.dead, key=str)],
                   "elapsed_s": time.perf_counter() - start}
        (args.out / "h200-moe-tiles.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
