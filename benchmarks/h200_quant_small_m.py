"""Decode-size GEMMs on one GPU: every candidate plan (kernel, tiles, K split) of the weight-only fp8 and
int4 GEMMs and of the W8A8 fp8 small-M GEMM per Llama-3-8B layer shape and M, against bf16 cuBLAS and the
bytes floor.

    python benchmarks/h200_quant_small_m.py --out benchmarks/results/h200-quant-small-m.json
    (or: python benchmarks/h200_quant.py --cases small-m)

Families: "fp8_row" (per-row / per-tensor scales: vLLM "fp8" per-tensor Llama), "fp8_block" (128x128 block
scales), "int4_g128" (GPTQ / AWQ, group 128 in order); "fp8_row_w8a8" / "fp8_block_w8a8": the same weights
through the W8A8 small-M GEMM ("dot_w8a8", `fp8_w8a8_small_m_triton`: activations quantized per token /
per token and 128-group in its prologue), M <= 32 (fp8_native.SMALL_M_MAX_M: the bound the sweep decides, small_m_plan.w8a8_max_m, lies at or below it), rows of their own (their
"default" is small_m_plan.w8a8_plan's), filling small_m_plan's "fp8_row_w8a8" / "fp8_block_w8a8" tables.
Asking for "fp8_row" / "fp8_block" sweeps its W8A8 family too. Only the W8A8 small-M GEMM:
    python benchmarks/h200_quant_small_m.py --families fp8_row_w8a8 fp8_block_w8a8 --budget-s 400 \
        --out benchmarks/results/h200-quant-small-m-w8a8.json
Prediction for the W8A8 families' "gemv" candidates at M = 1 (the weight-only GEMV's loop on activations
quantized in it; not measured): fp8_row_w8a8 ~82 us per four layers (the weight-only GEMV 80.4 plus a
prologue of one 8 KB load), beating dot_w8a8's 91; fp8_block_w8a8 ~100 (weight-only 97.9, dot_w8a8 103).
Prediction for dot_w8a8 (measured at e73eee6: 90.4, the prologue and the reduce hold it): Llama-8B's four GEMMs at M = 1 ~60 us (55-68; the weight-only
gemv 80.4, cuBLAS W8A8 137): no conversion per weight element, so bound by the weight's bytes and the
split's second launch. Candidates (`candidates`): the shipped default
(`small_m_plan`), the tensor-core "dot" kernel over a few tiles x K splits 1-8, the "gemv" kernel
(M <= 8) over a few tiles x K splits 1-4, and for int4 the "gemv_fold" kernel (M <= 16, zero point folded
out of the inner loop) over a few tiles x K splits 1-8. Only the int4 kernels, against the current plans:
    python benchmarks/h200_quant_small_m.py --families int4_g128 --budget-s 400 \
        --out benchmarks/results/h200-int4-fold.json
(gemv_fold's candidates run first, so a budget cut drops the older plans, never the shipped default.)
Prediction for gemv_fold (not measured): Llama-8B's four layers at M = 1 ~40-50 us (best plan today
140 us, floor 26.6 us), M = 2 ~55-65, M = 4 ~80-95, M = 8 ~120-130 (dot today 142), M = 16 ~200+ (dot
stays): sm_90 SASS of the loop gives ~4.0 / 6.8 / 10.3 / 16 / 28 instructions per weight element at
M = 1 / 2 / 4 / 8 / 16 (the dot plan ~7.7 and an I2F per element, the plain gemv ~13); at 4
warp-instructions per clock per SM and ~1.75 GHz over 132 SMs that is ~29 / 50 / 77 / 118 / 206 us of
issue for the 218 M weight elements, and M = 1 is then held up by memory (~75% of copy bandwidth).
Each is timed as CUDA-graph replays over weight copies larger than L2 (h200_quant.graph_us), so neither
launch cost nor cache hits flatter it. Per row: each candidate's us, the best one and its TB/s of weight bytes, bf16 cuBLAS, fp8's W8A8 path ("w8a8_us":
activation quantization + _scaled_mm / Triton block GEMM, what fp8_native runs past SMALL_M_MAX_M),
and "floor_us" = weight bytes over the copy bandwidth. Then per family and M the plan with the least total time over the four layers
("best_per_bucket": what small_m_plan's tables take), printed and written. Meant to finish in < 3
minutes on an H200 (compiles dominate: `compile_count` bounds them); `--budget-s` stops adding
candidates past it, keeping what was measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

_here = Path(__file__).resolve().parent
MS = (1, 2, 4, 8, 16, 32, 64)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# --shapes dsv2lite: DeepSeek-V2-Lite's dense decode projections (block fp8 quantizes them; the routed experts
# run the fused MoE): MLA's fused q / kv_a (3072 + 576 rows), o_proj, the shared experts' gate_up and down.
# The tables are tuned on Llama-8B's K of 4096-14336; these have K 2048-2816, where the M = 1 W8A8 plan's 8
# splits leave 2-3 K tiles a split (its DSV2 block-fp8 batch-1 step ran 133 such launches, 1.17 of 3.89 GPU ms
# on an H100 at 006b5ec, and the step was slower than bf16's).
ARCH_SHAPES = {"llama8b": SHAPES,
               "dsv2lite": {"qkv_a": (3648, 2048), "o": (2048, 2048), "shared_gate_up": (5632, 2048),
                            "shared_down": (2048, 2816)}}
FAMILIES = ("fp8_row", "fp8_block", "int4_g128", "fp8_row_w8a8", "fp8_block_w8a8")
W8A8_SUFFIX = "_w8a8"
W8A8_MS = (1, 2, 4, 8, 16, 32)  # the W8A8 small-M path serves M <= fp8_native.SMALL_M_MAX_M
# "dot_w8a8": (BLOCK_N weight rows (the MMA's M), BLOCK_K, num_warps), token tiles of 16 (and 32); each compiles
# once per power of two of M (the rows it quantizes), so few tiles: a 64-row tile gives 4096-row layers 64
# programs a split, a 128-row one half as many with twice the MMA per weight load
W8A8_TILES = {"fp8_row_w8a8": [(64, 128, 4), (128, 128, 4), (64, 256, 4), (128, 128, 8)],
              "fp8_block_w8a8": [(64, 128, 4), (128, 128, 4), (128, 128, 8)]}
W8A8_SPLITS = (1, 2, 4, 8)
W8A8_GEMV_MAX_M = 2  # the W8A8 families' "gemv" candidates (the weight-only GEMV won M = 1 only)
DOT_TILES = {"fp8_row": [(32, 256), (64, 128), (16, 256)], "fp8_block": [(32, 128), (64, 128)],
             "int4_g128": [(32, 128), (64, 128), (16, 128)]}
GEMV_TILES = {"fp8_row": [(4, 512), (8, 512), (16, 256), (32, 128), (8, 128), (4, 256)],
              "fp8_block": [(8, 128), (16, 128), (32, 128)],
              "int4_g128": [(16, 128), (32, 128), (64, 64), (32, 64), (16, 64), (8, 128)]}
DOT_SPLITS = (1, 2, 4, 8)
GEMV_SPLITS = (1, 2, 4)
GEMV_MAX_M = 8
GEMV_MAX_ELEMENTS = 8192  # BLOCK_M * BLOCK_N * BLOCK_K float32 products a 4-warp program holds
# int4 "gemv_fold" (int4_gemv_fold_triton): (BLOCK_N, BLOCK_K, num_warps); each thread holds BLOCK_M x 4 words
# x 4 columns of the tile per 128 threads, so wide tiles share each activation over more columns. sm_90
# SASS (no GPU): 4 warps spill from BLOCK_M * BLOCK_N * BLOCK_K = 65536 at BLOCK_M >= 8 (8x64x128,
# 16x32x128), not at 4x128x128; 1x128x128 is ~4.0 instructions per weight element, 1x32x128 ~5.0.
# BLOCK_K past the group (512, 1024: s / z per word row, ~+0.25 instructions per element) gives each program
# fewer, longer tiles: K reach without a split's second launch (o / qkv: 4096 inputs, 32 tiles of 128).
FOLD_TILES = [(128, 128, 4), (256, 64, 4), (64, 128, 4), (32, 128, 4), (128, 64, 4), (32, 64, 4), (256, 128, 8),
              (32, 512, 4), (16, 1024, 4), (32, 1024, 8)]
FOLD_SPLITS = (1, 2, 4, 8)
FOLD_MAX_M = 16
PIPE_MAX_M = 2  # gemv / gemv_fold with the loop pipelined (num_stages: tl.range copies tiles ahead into shared memory)
PIPE_STAGES = (3, 4)
PIPE_MAX_SMEM = 96 * 1024  # bytes of shared memory a program's stages may take
PIPE_MIN_K = 256  # fp8_row gemv tiles pipelined: BLOCK_K >= this (block fp8's are all 128, its group: all pipelined)
# Pipelined gemv_fold (int4) and W8A8 GEMV candidates are not swept: on an H100 at 83ecae0 every one lost to the
# plain loop on every layer (int4 by 10-25%, W8A8 ~1.5-1.8x; h100-quant-small-m-pipelined-83ecae0.json): gemv_fold's
# 2-byte activation loads stay in its loop (cp.async moves 4-16 bytes), so pipelining adds barriers, not overlap.


def _fold_fits(bm: int, bn: int, bk: int, warps: int) -> bool:
    return bm * bn * bk <= (65536 if bm <= 4 else 32768) * warps // 4


def _pow2(m: int) -> int:
    return 1 << (m - 1).bit_length()


def _piped(family: str, bk: int) -> bool:
    """Whether the sweep tries the fp8 GEMV tile of BLOCK_K bk pipelined."""
    return family.startswith("fp8_block") or bk >= PIPE_MIN_K


def _pipe_stages(m: int, stage_bytes: int) -> tuple[int, ...]:
    """The pipeline depths swept for a GEMV tile whose loads take stage_bytes of shared memory a stage."""
    return tuple(s for s in PIPE_STAGES if m <= PIPE_MAX_M and s * stage_bytes <= PIPE_MAX_SMEM)


def candidates(family: str, m: int) -> dict:
    """label -> SmallMPlan (None: the shipped default) for one family and M."""
    from keel_quantization.small_m_plan import SmallMPlan, _block_m

    out: dict = {"default": None}
    if family.endswith(W8A8_SUFFIX):
        if m <= W8A8_GEMV_MAX_M:  # first: the GEMV on quantized activations (its block K tile: the group)
            base = family.removesuffix(W8A8_SUFFIX)
            for bn, bk in GEMV_TILES[base]:
                if _pow2(m) * bn * bk <= GEMV_MAX_ELEMENTS and (base == "fp8_row" or bk == 128):
                    for split in GEMV_SPLITS:
                        out[f"gemv {_pow2(m)}x{bn}x{bk} s{split}"] = SmallMPlan("gemv", _pow2(m), bn, bk, split)
        for bm in sorted({16, _block_m(m)}):  # M 17-32 in token tiles of 16 too (the weight read twice, from L2)
            for bn, bk, warps in W8A8_TILES[family]:
                for split in W8A8_SPLITS:
                    out[f"dot_w8a8 {bm}x{bn}x{bk} w{warps} s{split}"] = SmallMPlan(
                        "dot_w8a8", bm, bn, bk, split, num_warps=warps, num_stages=4)
        return out
    stages = 4 if family != "int4_g128" else None
    if family == "int4_g128" and m <= FOLD_MAX_M:  # first: a budget cut never skips the new kernel
        for bn, bk, warps in FOLD_TILES:
            if _fold_fits(_pow2(m), bn, bk, warps):
                for split in FOLD_SPLITS:
                    out[f"gemv_fold {_pow2(m)}x{bn}x{bk} w{warps} s{split}"] = SmallMPlan(
                        "gemv_fold", _pow2(m), bn, bk, split, num_warps=warps)
    for bm in sorted({16, _block_m(m)}):  # M > 16 in M tiles of 16 too: smaller tiles, more programs
        for bn, bk in DOT_TILES[family]:
            for split in DOT_SPLITS:
                out[f"dot {bm}x{bn}x{bk} s{split}"] = SmallMPlan("dot", bm, bn, bk, split, num_stages=stages)
    if m <= GEMV_MAX_M:
        for bn, bk in GEMV_TILES[family]:
            if _pow2(m) * bn * bk > GEMV_MAX_ELEMENTS:
                continue
            for split in GEMV_SPLITS:
                out[f"gemv {_pow2(m)}x{bn}x{bk} s{split}"] = SmallMPlan("gemv", _pow2(m), bn, bk, split)
                if family != "int4_g128" and _piped(family, bk):  # fp8_gemv_triton's loop pipelined
                    for depth in _pipe_stages(m, bn * bk + 2 * _pow2(m) * bk):
                        out[f"gemv {_pow2(m)}x{bn}x{bk} p{depth} s{split}"] = SmallMPlan(
                            "gemv", _pow2(m), bn, bk, split, num_stages=depth)
    return out


MS_SWEPT: tuple[int, ...] | None = None  # --ms: only these M


def family_ms(family: str) -> tuple[int, ...]:
    ms = W8A8_MS if family.endswith(W8A8_SUFFIX) else MS
    return ms if MS_SWEPT is None else tuple(m for m in ms if m in MS_SWEPT)


def compile_count(family: str) -> int:
    """Distinct kernels the family's candidates compile (the split is a runtime argument; dot_w8a8 compiles
    per power of two of M up to its token tile, the rows it quantizes)."""
    return len({(p.kernel, p.block_m, p.block_n, p.block_k, p.num_warps, p.num_stages,
                 min(p.block_m, _pow2(m)) if p.kernel == "dot_w8a8" else 0)
                for m in family_ms(family) for p in candidates(family, m).values() if p is not None})


def _weights(family: str, n: int, k: int, gen: torch.Generator) -> tuple[list, int]:
    """(copies of one layer's quantized weight, bytes of one copy): > 256 MiB of copies, never from L2."""
    from keel_quantization import fp8_math

    family = family.removesuffix(W8A8_SUFFIX)
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
    nbytes = n * k // 2 if family == "int4_g128" else n * k
    copies = max(2, -(-(256 << 20) // nbytes))
    if family == "fp8_row":
        q, s = fp8_math.quantize_per_row(w)
        return [(q.clone(), s.reshape(-1, 1).clone()) for _ in range(copies)], nbytes
    if family == "fp8_block":
        q, s = fp8_math.quantize_blocks(w, (128, 128))
        return [(q.clone(), s.clone()) for _ in range(copies)], nbytes
    words = torch.randint(-(1 << 31), 1 << 31, (k // 8, n), device="cuda", generator=gen, dtype=torch.int64)
    scales = torch.rand(k // 128, n, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.01
    zeros = torch.full_like(scales, 8.0)
    g_idx = torch.arange(k, device="cuda", dtype=torch.int32) // 128
    return [(words.to(torch.int32), scales.clone(), zeros.clone(), g_idx) for _ in range(copies)], nbytes


def _fn(family: str, x: torch.Tensor, weights: list, plan):
    from keel_quantization.fp8_triton import fp8_weight_only_gemm
    from keel_quantization.int4_triton import int4_gemm

    k = x.shape[1]
    if family == "int4_g128":
        return lambda i: int4_gemm(x, *weights[i], group_size=128, plan=plan)
    group = (1, k) if family.startswith("fp8_row") else (128, 128)
    if family.endswith(W8A8_SUFFIX):
        from keel_quantization.fp8_w8a8_small_m_triton import fp8_w8a8_small_m_gemm

        act = "dynamic_token" if family.startswith("fp8_row") else "dynamic_group"
        return lambda i: fp8_w8a8_small_m_gemm(x, *weights[i], *group, act, plan=plan)
    return lambda i: fp8_weight_only_gemm(x, *weights[i], *group, plan=plan)


def _w8a8_fn(family: str, x: torch.Tensor, weights: list):
    from keel_quantization.fp8_native import native_linear

    if family.startswith("fp8_row"):
        return lambda i: native_linear("scaled_mm", x, weights[i][0], weights[i][1].reshape(-1), "dynamic_token",
                                       None, None, None)
    return lambda i: native_linear("triton", x, *weights[i], "dynamic_group", (128, 128), None, None)


def sweep(families: list[str], copy_bw_gbps: float, budget_s: float) -> dict:
    quant = _sibling("h200_quant")
    gen = torch.Generator(device="cuda").manual_seed(0)
    start = time.perf_counter()
    rows, skipped = [], 0
    for f, family in enumerate(families):
        family_budget = start + budget_s * (f + 1) / len(families)  # each family its share of the budget
        for layer, (n, k) in SHAPES.items():
            weights, nbytes = _weights(family, n, k, gen)
            dense = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16)
                     for _ in range(max(2, -(-(256 << 20) // (2 * n * k))))]
            for m in family_ms(family):
                x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
                row = {"family": family, "layer": layer, "n": n, "k": k, "m": m, "weight_bytes": nbytes,
                       "floor_us": nbytes / copy_bw_gbps / 1e3,
                       "bf16_cublas_us": quant.graph_us(lambda i, x=x, d=dense: x @ d[i].T, len(dense)), "us": {}}
                if family != "int4_g128":  # the W8A8 path fp8_native takes past SMALL_M_MAX_M
                    row["w8a8_us"] = quant.graph_us(_w8a8_fn(family, x, weights), len(weights))
                for label, plan in candidates(family, m).items():
                    if time.perf_counter() > family_budget and label != "default":
                        skipped += 1
                        continue
                    row["us"][label] = quant.graph_us(_fn(family, x, weights, plan), len(weights))
                best = min(row["us"], key=row["us"].get)
                row.update(best=best, best_us=row["us"][best], best_TBps=nbytes / row["us"][best] / 1e6,
                           default_TBps=nbytes / row["us"]["default"] / 1e6)
                rows.append(row)
                print("small-m", json.dumps({kk: (round(v, 2) if isinstance(v, float) else v)
                                             for kk, v in row.items() if kk != "us"}), flush=True)
            del weights, dense
            torch.cuda.empty_cache()
    return {"rows": rows, "best_per_bucket": best_per_bucket(rows), "skipped_over_budget": skipped,
            "sweep_s": time.perf_counter() - start}


def best_per_bucket(rows: list[dict]) -> dict:
    """family -> M -> the label with the least total us over the layers that measured it on all of them, and
    under "layers" each layer whose own best beat that label on it by small_m_plan.LAYER_MARGIN."""
    from keel_quantization.small_m_plan import LAYER_MARGIN

    out: dict = {}
    for family in {r["family"] for r in rows}:
        for m in sorted({r["m"] for r in rows if r["family"] == family}):
            group = [r for r in rows if r["family"] == family and r["m"] == m]
            labels = set.intersection(*(set(r["us"]) for r in group))
            total = {lb: sum(r["us"][lb] for r in group) for lb in labels}
            best = min(total, key=total.get)
            floor = sum(r["floor_us"] for r in group)
            cands = candidates(family, m)
            plan = cands.get(best)
            layers = {}
            for r in group:
                own = min(r["us"], key=r["us"].get)
                own_plan = cands.get(own)
                if own_plan is not None and r["us"][own] * (1 + LAYER_MARGIN) <= r["us"][best]:
                    layers[r["layer"]] = {"n": r["n"], "k": r["k"], "best": own, "plan": dataclasses.asdict(own_plan),
                                          "us": r["us"][own], "bucket_best_us": r["us"][best]}
            out.setdefault(family, {})[str(m)] = {
                "best": best, "plan": None if plan is None else dataclasses.asdict(plan), "total_us": total[best], "default_total_us": total["default"],
                "bf16_cublas_total_us": sum(r["bf16_cublas_us"] for r in group), "floor_total_us": floor,
                "w8a8_total_us": sum(r.get("w8a8_us", float("nan")) for r in group),
                "best_over_floor": total[best] / floor, "layers": layers,
                "with_layers_total_us": total[best] - sum(v["bucket_best_us"] - v["us"] for v in layers.values())}
    return out


TABLE_KEYS = {"fp8_row": "fp8_row", "fp8_block": "fp8_block", "int4_g128": "int4",
              "fp8_row_w8a8": "fp8_row_w8a8", "fp8_block_w8a8": "fp8_block_w8a8"}


def expand_families(families: list[str]) -> list[str]:
    """--families as swept: "fp8_row" / "fp8_block" bring their W8A8 family, in FAMILIES' order."""
    wanted = set(families) | {f + W8A8_SUFFIX for f in families if f + W8A8_SUFFIX in FAMILIES}
    return [f for f in FAMILIES if f in wanted]


def tables(best: dict) -> dict:
    """best_per_bucket -> small_m_plan.use_tables' argument (family -> ((largest M, plan or None), ...)).
    A W8A8 family's table ends before the first M its best plan loses to the large-M W8A8 path: its last
    bucket is the largest M the small-M GEMM serves (small_m_plan.w8a8_max_m)."""
    from keel_quantization.small_m_plan import SHIPPED, SmallMPlan

    def shipped(family: str, m: int) -> SmallMPlan | None:  # what "default" ran in the sweep: the shipped table's
        return next((plan for max_m, plan in SHIPPED.get(TABLE_KEYS[family], ()) if m <= max_m), None)

    out = {}
    for family, buckets in best.items():
        rows = []
        for m, b in sorted(buckets.items(), key=lambda kv: int(kv[0])):
            if family.endswith(W8A8_SUFFIX) and b["total_us"] >= b.get("w8a8_total_us", float("inf")):
                break
            # a "default" win keeps the shipped plan (None there: the built-in default, as in the sweep)
            rows.append((int(m), shipped(family, int(m)) if b["plan"] is None else SmallMPlan(**b["plan"])))
        out[TABLE_KEYS[family]] = tuple(rows)
    return out


def layer_plans(best: dict) -> dict:
    """best_per_bucket -> small_m_plan.use_tables' `layers` ((table family, N, K, bucket's largest M) -> plan),
    for the buckets tables(best) keeps."""
    from keel_quantization.small_m_plan import SmallMPlan

    kept = {(f, m) for f, rows in tables(best).items() for m, _ in rows}
    return {(TABLE_KEYS[family], v["n"], v["k"], int(m)): SmallMPlan(**v["plan"])
            for family, buckets in best.items() for m, b in buckets.items()
            for v in b.get("layers", {}).values() if (TABLE_KEYS[family], int(m)) in kept}


def use_swept_plans(result: dict) -> dict:
    """Make small_m_plan take a sweep's best plans over the shipped tables, for the families it swept -- before
    any layer runs (plans are cached per shape). `result`: this script's JSON, or h200_quant.py's holding a
    "small-m" case. Returns family -> M -> the label that won (what a result records as the plans it used)."""
    from keel_quantization import small_m_plan

    best = result.get("cases", {}).get("small-m", result)["best_per_bucket"]
    swept = tables(best)
    # the shipped per-layer plans of the families not swept stay; a swept family's are the sweep's
    kept = {key: plan for key, plan in small_m_plan.SHIPPED_LAYERS.items() if key[0] not in swept}
    small_m_plan.use_tables({**small_m_plan.SHIPPED, **swept}, {**kept, **layer_plans(best)})
    return {f: {m: b["best"] for m, b in buckets.items()} for f, buckets in best.items()}


def tables_literal(tables: dict, layers: dict | None = None) -> str:
    """small_m_plan.TABLES (and LAYER_PLANS) as Python source (what gets committed once measured)."""
    lines = ["TABLES: dict[str, tuple[tuple[int, SmallMPlan | None], ...]] = {"]
    for family, rows in tables.items():
        lines.append(f"    {family!r}: (")
        lines += [f"        ({m}, {plan!r})," for m, plan in rows]
        lines.append("    ),")
    lines.append("}")
    if layers is not None:
        lines.append("LAYER_PLANS: LayerPlans = {")
        lines += [f"    {key!r}: {plan!r}," for key, plan in sorted(layers.items())]
        lines.append("}")
    return "\n".join(lines)


def _sibling(name: str):
    from keel.testing.scripts import load_script

    return load_script(_here / f"{name}.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/h200-quant-small-m.json")
    ap.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--ms", help="comma-separated M to sweep (default: all of MS / W8A8_MS)")
    ap.add_argument("--shapes", choices=sorted(ARCH_SHAPES), default="llama8b",
                    help="whose layer shapes (the shipped tables are Llama-8B's)")
    ap.add_argument("--print-tables", metavar="RESULT_JSON",
                    help="no GPU: print small_m_plan.TABLES for a sweep's result (this script's or h200_quant's)")
    ns = ap.parse_args()
    global MS_SWEPT, SHAPES
    SHAPES = ARCH_SHAPES[ns.shapes]
    MS_SWEPT = tuple(int(m) for m in ns.ms.split(",")) if ns.ms else None
    if ns.print_tables:
        r = json.loads(Path(ns.print_tables).read_text())
        best = r.get("cases", {}).get("small-m", r)["best_per_bucket"]
        print(tables_literal(tables(best), layer_plans(best)))
        return
    import triton

    copy_bw = _sibling("h200_llama8b").ceilings()["copy_bw_GBps"]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "copy_bw_GBps": copy_bw, "shapes": ns.shapes, **sweep(expand_families(ns.families), copy_bw, ns.budget_s)}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=1, default=float))
    print(json.dumps(result["best_per_bucket"], indent=1, default=float))


if __name__ == "__main__":
    main()
