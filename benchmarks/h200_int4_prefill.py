"""Prefill-sized int4 GEMMs on one GPU (GPTQ / AWQ, group 128 in order) at Llama-3-8B's layer shapes: the
Triton GEMM that dequantizes tiles in registers (the shipped plan and a few larger tiles), a full dequantize
(`int4_dequant_triton`) then bf16 cuBLAS, the dequantize alone, and bf16 cuBLAS on a ready weight -- with
TFLOP/s and the dequantize's bytes over copy bandwidth.

    python benchmarks/h200_int4_prefill.py --out benchmarks/results/h200-int4-prefill.json

Why: the step profile of Llama-8B GPTQ at 8192 prefill tokens (h200-step-profile-llama8b-gptq-2ff973d.json)
spends 593 ms in the int4 GEMM, 3.7x bf16 cuBLAS's 162 ms for the same GEMMs. Prediction (unmeasured):
dequantize + cuBLAS ~1.05x bf16 cuBLAS at M = 8192 (the dequantize ~4.5 bytes a weight: ~0.13 ms for
gate_up, ~4-5 ms over the model's 128 GEMMs a step) and ahead of every Triton tile from M ~512;
larger Triton tiles (128 x 128, 8 warps) ~2x the shipped 64 x 64 plan, still short of cuBLAS. The result
("crossover") names the least M from which dequantize + cuBLAS wins on all four layers: int4_linear's
DEQUANT_GEMM_MIN_M.

At 3158d24 the Triton GEMM was ALU-bound on its dequantize: an int -> bf16 conversion per weight element on
sm_90's 16-a-clock conversion pipe, repeated for every M block. Now each nibble is or-ed into the bits of
bf16 128.0 and 128 + z subtracted in packed bf16 (no conversion); "shipped_float_dequant" times the old
path in the same run. Prediction: the shipped plans ~1.5x faster at M 16-256 (Llama-8B's four layers at
M = 256 769 -> ~500 us, dequantize + cuBLAS 477), so the crossover stays near 256 unless larger tiles
(128 x 128, 256 x 128) now beat cuBLAS there.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

_here = Path(__file__).resolve().parent
MS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the Triton dot kernel; BLOCK_K divides the group (128)
TILES = [(128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (64, 256, 64, 8, 3),
         (128, 64, 128, 4, 4), (64, 128, 128, 4, 3), (64, 64, 128, 4, 3), (64, 128, 64, 4, 4), (256, 128, 64, 8, 3),
         (16, 64, 128, 4, 3), (32, 64, 128, 4, 3)]


class float_dequant:
    """Within it the int4 GEMM dequantizes as before the or-ed nibbles (int -> float -> bf16 per weight)."""

    def __enter__(self):
        from keel_quantization import int4_triton

        self.saved = dict(int4_triton._MAGIC)
        int4_triton._MAGIC.clear()

    def __exit__(self, *exc):
        from keel_quantization import int4_triton

        int4_triton._MAGIC.update(self.saved)


def _sibling(name: str):
    from keel.testing.scripts import load_script

    return load_script(_here / f"{name}.py")


def _layer(n: int, k: int, gen: torch.Generator):
    words = torch.randint(-(1 << 31), 1 << 31, (k // 8, n), device="cuda", generator=gen, dtype=torch.int64)
    scales = torch.rand(k // 128, n, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.01
    return words.to(torch.int32), scales, torch.full_like(scales, 8.0), torch.arange(k, device="cuda",
                                                                                     dtype=torch.int32) // 128


def _in(ctx, fn, *args, **kw):
    with ctx:
        return fn(*args, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/h200-int4-prefill.json")
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="token counts M")
    ns = ap.parse_args()
    import triton

    from keel.bench import source_commit
    from keel_quantization.int4_dequant_triton import int4_dequantize
    from keel_quantization.int4_triton import int4_gemm
    from keel_quantization.small_m_plan import SmallMPlan

    llama = _sibling("h200_llama8b")
    ceil = llama.ceilings()
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = {name: _layer(n, k, gen) for name, (n, k) in SHAPES.items()}
    t0 = time.perf_counter()
    rows = []
    ms = tuple(int(v) for v in ns.ms.split(","))
    for m in ms:
        for name, (n, k) in SHAPES.items():
            qw, s, z, g = layers[name]
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            dense = int4_dequantize(qw, s, z, g, torch.bfloat16, 128)
            flops = 2 * m * n * k
            fns = {"shipped": lambda: int4_gemm(x, qw, s, z, g, group_size=128),
                   "shipped_float_dequant": lambda: _in(float_dequant(), int4_gemm, x, qw, s, z, g, group_size=128),
                   "dequant_cublas": lambda: x @ int4_dequantize(qw, s, z, g, torch.bfloat16, 128),
                   "dequant_only": lambda: int4_dequantize(qw, s, z, g, torch.bfloat16, 128, out=dense),
                   "bf16_cublas": lambda: x @ dense}
            if time.perf_counter() - t0 < ns.budget_s:
                for t in TILES:
                    plan = SmallMPlan("dot", t[0], t[1], t[2], num_warps=t[3], num_stages=t[4])
                    fns["x".join(map(str, t[:3])) + f"-w{t[3]}s{t[4]}"] = (
                        lambda plan=plan: int4_gemm(x, qw, s, z, g, group_size=128, plan=plan))
            row = {"m": m, "layer": name, "n": n, "k": k, "us": {}}
            for label, fn in fns.items():
                try:
                    row["us"][label] = llama._events_ms(fn, iters=10) * 1000
                except Exception as e:  # a tile that does not compile or fit is a result, not a crash
                    row["us"][label] = None
                    row.setdefault("errors", {})[label] = f"{type(e).__name__}: {str(e)[:200]}"
            timed = {lb: us for lb, us in row["us"].items() if us is not None and lb != "dequant_only"}
            row["tflops"] = {lb: flops / us / 1e6 for lb, us in timed.items()}
            row["dequant_floor_us"] = n * k * 2.5 / ceil["copy_bw_GBps"] / 1e3  # int4 read, bf16 written
            triton_us = [us for lb, us in timed.items() if lb not in ("dequant_cublas", "bf16_cublas",
                                                                       "shipped_float_dequant")]
            row["best_triton"] = min((us, lb) for lb, us in timed.items() if us in triton_us)[1]
            row["best_triton_us"] = min(triton_us)
            row["dequant_cublas_over_best_triton"] = row["us"]["dequant_cublas"] / row["best_triton_us"]
            rows.append(row)
            print(json.dumps({k_: row[k_] for k_ in ("m", "layer", "us")}, default=lambda v: round(v, 1)), flush=True)
    by_m = {}
    for r in rows:
        by_m.setdefault(r["m"], []).append(r)
    totals = {m: {lb: sum(r["us"][lb] for r in rs)
                  for lb in ("shipped", "shipped_float_dequant", "dequant_cublas", "bf16_cublas")}
              | {"best_triton": sum(r["best_triton_us"] for r in rs)} for m, rs in by_m.items()}
    wins = [m for m, rs in by_m.items() if all(r["dequant_cublas_over_best_triton"] < 1 for r in rs)]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": source_commit(_here) or "unknown", **ceil, "rows": rows, "us_per_four_layers": totals,
              "crossover": min((m for m in wins if all(w in wins for w in ms if w > m)), default=None)}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=1, default=float))
    print(json.dumps({"us_per_four_layers": totals, "crossover": result["crossover"]}, indent=1,
                     default=lambda v: round(v, 1)))


if __name__ == "__main__":
    main()
