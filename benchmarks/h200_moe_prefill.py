"""Where the fused-MoE grouped GEMMs lose time at prefill sizes, against a dense cuBLAS GEMM of the same FLOPs.

    python benchmarks/h200_moe_prefill.py --out benchmarks/results/h200-moe-prefill.json [--tokens 2048 8192]
    python benchmarks/h200_moe_prefill.py --smoke      # CPU, interpreted, tiny shapes: checks the script runs

DeepSeek-V2-Lite's MoE shape (64 experts, hidden 2048, intermediate 1408, top-6), uniform random routing, bf16.
At an 8192-token prefill step the two grouped GEMMs took 70.9 of the step's 111 ms of GPU time on an H200
(`h200_step_profile.py`), i.e. ~305 TFLOP/s, while a dense GEMM of the same size runs at ~600+. For each
token count this times, with CUDA events (median of 20):

- `w13`: the gate_up GEMM with the shipped tiles (without their epilogue), the K mask in the main loop (`even_k`
  False) and without;
- `w2_fused`: the down GEMM computing silu(gate) * up in its A load (the shipped path), K mask or not;
- `w2_unfused`: kernels-triton's silu_and_mul kernel, then the down GEMM on its output, for the shipped
  tile and a few others;
- `w13_epilogue`: the gate_up GEMM storing silu(gate) * up itself (ACT_EPILOGUE, a few tiles, TMA weights or
  not), and `pair_ms`: the two GEMMs (+ silu_and_mul) each way, shipped against epilogue + plain down GEMM
  (where the shipped w13 tile has the epilogue, "shipped" times that pair as the engine runs it; runs up to
  f6440a3 timed the shipped tile without its epilogue there and overstated the shipped path), and the pair through
  `torch._grouped_mm` (rows gathered into expert order, w13, silu_and_mul, w2: `_grouped_mm_pair`);
- `dense_*`: torch.mm of [pairs, K] x [K, N] (cuBLAS) -- the rate a GEMM of these FLOPs reaches without
  gathers, and the floor this compares against.

Prediction (recorded before the run): the K mask costs little (<5%); the unfused activation saves ~25% of
the down GEMM at 8192 tokens (the fused A load recomputes silu for each of 16 N-blocks and reads gate and
up), minus ~0.12 ms for the separate kernel's 415 MB.
Prediction for the epilogue (before any run, 2026-12-06): an H200 8192-token DSV2-Lite prefill step spent
5.0 of 88 GPU ms in silu_and_mul (h200-step-profile-dsv2lite-8f461cc.json, 53 launches): the epilogue pair
saves ~0.15-0.2 ms a layer at 8192 tokens (the activation's 415 MB round trip and half of w13's stores) if its
two accumulators keep w13's rate; with 128-wide tiles the 2 x 128 x 128 float32 accumulators spill at 4 warps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from h200_llama8b import _events_ms as _cuda_events_ms

E, H, INTER, TOP_K = 64, 2048, 1408, 6


def _events_ms(fn) -> float:
    """The sibling benchmarks' CUDA-event median (h200_llama8b._events_ms); --smoke: one wall-clock run."""
    if torch.cuda.is_available():
        return _cuda_events_ms(fn)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def run(tokens: int, device: str, dtype: torch.dtype, e: int, h: int, inter: int, top_k: int) -> dict:
    from keel_kernels_triton.fused_moe.align import moe_align_block_size
    from keel_kernels_triton.fused_moe.grouped_gemm import invoke_fused_moe_kernel
    from keel_kernels_triton.fused_moe.tile_config import MoETileConfig, get_moe_tile_configs
    from keel_kernels_triton.ops import TritonSiluAndMul
    from keel_kernels_triton.support import interpreter_enabled

    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, h, device=device, dtype=dtype, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, device=device, dtype=dtype, generator=gen) * 0.02
    w2 = torch.randn(e, h, inter, device=device, dtype=dtype, generator=gen) * 0.02
    ids = torch.rand(tokens, e, device=device, generator=gen).topk(top_k, dim=-1).indices.to(torch.int32)
    weights = torch.rand(tokens * top_k, device=device, generator=gen, dtype=torch.float32)
    c13, c2 = get_moe_tile_configs(tokens, tuple(w13.shape), tuple(w2.shape), top_k, dtype, torch.device(device),
                                   interpreter_enabled())
    rows = tokens * top_k
    silu_and_mul = TritonSiluAndMul()
    gate_up = torch.empty(rows, 2 * inter, device=device, dtype=dtype)
    act = torch.empty(rows, inter, device=device, dtype=dtype)
    down = torch.empty(rows, h, device=device, dtype=dtype)
    flops13, flops2 = 2.0 * rows * h * 2 * inter, 2.0 * rows * inter * h
    out: dict = {"tokens": tokens, "pairs": rows, "w13_tile": c13.to_json(), "w2_tile": c2.to_json()}

    def tflops(flops: float, ms: float) -> float:
        return round(flops / ms / 1e9, 1)

    def align(cfg):
        return moe_align_block_size(ids, e, cfg.block_m)

    s13 = align(c13)
    for even in (False, True):
        ms = _events_ms(lambda: invoke_fused_moe_kernel(x, w13, gate_up, None, *s13, top_k, c13, even_k=even))
        out[f"w13_ms_even_k_{even}"] = round(ms, 4)
        out[f"w13_tflops_even_k_{even}"] = tflops(flops13, ms)
    for even in (False, True):
        ms = _events_ms(lambda: invoke_fused_moe_kernel(gate_up, w2, down, weights, *s13, 1, c2, act_silu=True,
                                                        even_k=even))
        out[f"w2_fused_ms_even_k_{even}"] = round(ms, 4)
        out[f"w2_fused_tflops_even_k_{even}"] = tflops(flops2, ms)
    out["silu_and_mul_ms"] = round(_events_ms(lambda: silu_and_mul(gate_up)), 4)
    candidates = [c2] + [MoETileConfig(c2.block_m, n, k, w, s, 1, g) for n, k, w, s, g in
                         ((128, 64, 4, 3, 8), (128, 64, 4, 4, 8), (256, 64, 8, 3, 8), (128, 128, 8, 3, 8),
                          (256, 64, 8, 4, 8))]
    unfused = []
    for cfg in candidates:
        if cfg.block_m != c13.block_m:
            continue
        try:
            ms = _events_ms(lambda: invoke_fused_moe_kernel(act, w2, down, weights, *s13, 1, cfg))
        except Exception as exc:  # a tile the device cannot hold (shared memory): recorded, not fatal
            unfused.append({"tile": cfg.to_json(), "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            continue
        unfused.append({"tile": cfg.to_json(), "ms": round(ms, 4), "tflops": tflops(flops2, ms)})
    out["w2_unfused"] = unfused
    best = min((u["ms"] for u in unfused if "ms" in u), default=None)
    if best is not None:
        out["w2_unfused_best_plus_act_ms"] = round(best + out["silu_and_mul_ms"], 4)
    # w13 storing silu(gate) * up itself (ACT_EPILOGUE: a program computes a gate tile and its up tile), then
    # the plain down GEMM: no silu_and_mul launch, half the w13 stores. The decode files take it up to 256
    # tokens; prefill sizes run w13, silu_and_mul, then the down GEMM
    epilogue = []
    plain_w2 = min((u for u in unfused if "ms" in u), key=lambda u: u["ms"], default=None)
    for n, k, w, st, g, tma in ((64, 64, 4, 3, 8, False), (64, 64, 8, 3, 8, False), (128, 64, 8, 3, 8, False),
                                (64, 128, 8, 3, 8, False), (64, 64, 4, 4, 8, True), (128, 64, 8, 3, 8, True)):
        cfg = MoETileConfig(c13.block_m, n, k, w, st, 1, g, weight_tma=tma and device == "cuda",
                            act_epilogue=True)
        try:
            ms = _events_ms(lambda: invoke_fused_moe_kernel(x, w13, act, None, *s13, top_k, cfg, gated=True))
        except Exception as exc:  # a tile the device cannot hold: recorded, not fatal
            epilogue.append({"tile": cfg.to_json(), "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            continue
        epilogue.append({"tile": cfg.to_json(), "ms": round(ms, 4), "tflops": tflops(flops13, ms)})
    out["w13_epilogue"] = epilogue
    best_epi = min((u for u in epilogue if "ms" in u), key=lambda u: u["ms"], default=None)
    if best_epi is not None and plain_w2 is not None:
        # the whole MoE GEMM pair each way: shipped (w13, silu in w2's A load or its own kernel; or, where the
        # shipped w13 tile has the epilogue, that pair as the engine runs it) vs the sweep's epilogue pair
        if c13.act_epilogue:
            shipped = (_events_ms(lambda: invoke_fused_moe_kernel(x, w13, act, None, *s13, top_k, c13, gated=True))
                       + _events_ms(lambda: invoke_fused_moe_kernel(act, w2, down, weights, *s13, 1, c2)))
        else:
            shipped = out[f"w13_ms_even_k_{False}"] + min(out[f"w2_fused_ms_even_k_{False}"],
                                                         out.get("w2_unfused_best_plus_act_ms", float("inf")))
        out["pair_ms"] = {"shipped": round(shipped, 4), "epilogue": round(best_epi["ms"] + plain_w2["ms"], 4)}
        out["epilogue_pair_tiles"] = {"w13": best_epi["tile"], "w2": plain_w2["tile"]}
    grouped = _grouped_mm_pair(x, w13, w2, ids, s13[0], e, top_k, c13.block_m, silu_and_mul, flops13, flops2)
    out["grouped_mm"] = grouped
    if "pair_ms" in out and "pair_ms" in grouped:
        out["pair_ms"]["grouped_mm"] = grouped["pair_ms"]
    a13 = torch.randn(rows, h, device=device, dtype=dtype, generator=gen)
    b13 = torch.randn(h, 2 * inter, device=device, dtype=dtype, generator=gen)
    b2 = torch.randn(inter, h, device=device, dtype=dtype, generator=gen)
    ms = _events_ms(lambda: torch.mm(a13, b13))
    out["dense_w13_ms"], out["dense_w13_tflops"] = round(ms, 4), tflops(flops13, ms)
    ms = _events_ms(lambda: torch.mm(act, b2))
    out["dense_w2_ms"], out["dense_w2_tflops"] = round(ms, 4), tflops(flops2, ms)
    return out


def _grouped_mm_pair(x, w13, w2, ids, sorted_ids, e: int, top_k: int, block_m: int, silu_and_mul, flops13: float,
                     flops2: float) -> dict:
    """The same MoE GEMM pair through torch's grouped GEMM (`torch._grouped_mm`, CUTLASS on sm_90): the hidden rows
    gathered into expert order (`sorted_ids`: the align kernel's layout, each expert's run padded to block_m), w13,
    silu_and_mul, w2, each timed, and the gather back to (token, slot) order that a combine would fold in.
    Whether a library grouped GEMM beats the Triton one at prefill sizes before any engine path is built on it.
    Prediction (2026-12-07, before any run; H100, 8192 tokens): the GEMMs at ~600-700 TFLOPS (cuBLAS dense 774 /
    666 on the same FLOPs, the Triton pair 480 / 385), w13 + w2 ~1.3 ms against the epilogue pair's 1.92, plus
    ~0.25 ms of gather and silu_and_mul the epilogue pair does not pay."""
    if not hasattr(torch, "_grouped_mm"):
        return {"error": "this torch has no _grouped_mm"}
    tokens, rows = x.shape[0], ids.numel()
    counts = torch.bincount(ids.reshape(-1).long(), minlength=e)
    offs = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0).to(torch.int32)  # [E] padded run ends
    idx = torch.clamp(sorted_ids // top_k, max=tokens - 1)
    w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)  # [E, K, N] views of the [E, N, K] weights
    out: dict = {}
    try:
        a = x.index_select(0, idx)
        gate_up = torch._grouped_mm(a, w13t, offs=offs)  # [padded rows, 2I]
        act = silu_and_mul(gate_up)
        down = torch._grouped_mm(act, w2t, offs=offs)  # [padded rows, H]
        inv = torch.empty(rows + 1, dtype=torch.int64, device=x.device)
        inv.scatter_(0, sorted_ids.long(), torch.arange(sorted_ids.numel(), device=x.device))  # pair -> position
        inv = inv[:rows]
        got = down.index_select(0, inv)  # [rows, H], (token, slot) order
        ref = torch.stack([x[p // top_k].float() @ w13[ids.reshape(-1)[p]].float().T for p in range(0, rows,
                                                                                                    max(1, rows // 8))])
        mid = gate_up.index_select(0, inv[::max(1, rows // 8)]).float()
        out["w13_max_abs_diff_vs_float32"] = round((mid - ref).abs().max().item(), 4)
        out["down_rows"] = list(got.shape)
        timings = {"gather": lambda: x.index_select(0, idx), "w13": lambda: torch._grouped_mm(a, w13t, offs=offs),
                   "silu_and_mul": lambda: silu_and_mul(gate_up), "w2": lambda: torch._grouped_mm(act, w2t, offs=offs),
                   "unpermute": lambda: down.index_select(0, inv)}
        ms = {k: round(_events_ms(fn), 4) for k, fn in timings.items()}
    except Exception as exc:  # an unsupported layout or device: recorded, not fatal
        return {**out, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    out["ms"] = ms
    out["w13_tflops"] = round(flops13 / ms["w13"] / 1e9, 1)
    out["w2_tflops"] = round(flops2 / ms["w2"] / 1e9, 1)
    out["pair_ms"] = round(ms["gather"] + ms["w13"] + ms["silu_and_mul"] + ms["w2"], 4)
    return out


def write_configs(results: list[dict], shape: dict, device_name: str, folder: Path) -> dict[str, list[int]]:
    """Copies of this device's shipped w13 / w2 tile files into `folder` (a KEEL_MOE_TILE_CONFIG_DIR for the engine
    A/B), with the epilogue pair's tiles at each token count where the pair beat the shipped path. Returns
    {file name: token counts changed}. Both tiles share the token count's BLOCK_SIZE_M (the sorted rows are padded
    to it), since the sweep keeps the shipped w13 tile's."""
    from keel_kernels_triton.fused_moe.tile_config import (CONFIG_DIR, MoETileConfig, config_file_name,
                                                           read_tile_config_file, write_tile_config_file)

    e, h, inter = shape["e"], shape["h"], shape["inter"]
    folder.mkdir(parents=True, exist_ok=True)
    changed: dict[str, list[int]] = {}
    for which, n, k in (("w13", 2 * inter, h), ("w2", h, inter)):
        name = config_file_name(e, n, k, device_name)
        configs = read_tile_config_file(CONFIG_DIR / name) if (CONFIG_DIR / name).exists() else {}
        for r in results:
            pair = r.get("pair_ms")
            if pair and pair["epilogue"] < pair["shipped"]:
                configs[r["tokens"]] = MoETileConfig.from_json(r["epilogue_pair_tiles"][which])
                changed.setdefault(name, []).append(r["tokens"])
        write_tile_config_file(folder / name, configs)
    return changed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreted, tiny shapes")
    ap.add_argument("--write-configs", default=None, metavar="DIR",
                    help="this device's shipped tile files with the epilogue pair's tiles where it won, into DIR "
                         "(KEEL_MOE_TILE_CONFIG_DIR for an engine A/B before they replace the shipped entries)")
    a = ap.parse_args()
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        shape = dict(e=4, h=32, inter=32, top_k=2)
        results = [run(t, "cpu", torch.float32, **shape) for t in (8,)]
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --smoke)")
        shape = dict(e=E, h=H, inter=INTER, top_k=TOP_K)
        results = []
        for t in a.tokens:
            results.append(run(t, "cuda", torch.bfloat16, **shape))
            print(json.dumps(results[-1]), flush=True)
    import triton

    doc = {"shape": shape, "results": results, "versions": {
        "torch": torch.__version__, "triton": triton.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"},
        "commit": os.environ.get("KEEL_COMMIT", "unknown")}
    if a.write_configs:
        doc["configs_written"] = write_configs(results, shape, doc["versions"]["device"], Path(a.write_configs))
        print(json.dumps({"configs_written": doc["configs_written"]}), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))
    if a.smoke:
        print(json.dumps(doc)[:400])


if __name__ == "__main__":
    main()
