"""torch._scaled_mm (row-wise scales, the engine's large-M W8A8 path) with and without `use_fast_accum`, at
Llama-3-8B's projection shapes and M 1024 / 8192: ms per GEMM, TFLOPS, and how far each output is from the exact
product of the same e4m3 operands, beside how far that product is from the unquantized operands' (relative to the
output's rms); for scale, also one scale per tensor (exact / fast) and
the bf16 GEMM. vLLM's CUTLASS W8A8 kernel for M > 128 on sm_90 uses the FP8 fast-accumulation schedule
(KernelTmaWarpSpecializedPingpongFP8FastAccum); keel's follow fp8_native.FAST_ACCUM, on since f49f7fb on
these figures (h100-fp8-fast-accum-9a71d88.json).

    python benchmarks/h200_fp8_fast_accum.py --out FILE.json    (~30 s)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for m in (1024, 8192):
        for name, (n, k) in SHAPES.items():
            # the engine's W8A8: bf16 activations and weights quantized per token / per output channel
            xo = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            wo = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
            sa = xo.float().abs().amax(1, keepdim=True) / 448  # [m, 1]
            sb = wo.float().abs().amax(1, keepdim=True) / 448  # [n, 1]
            x = (xo.float() / sa).to(torch.float8_e4m3fn)
            w = (wo.float() / sb).to(torch.float8_e4m3fn)
            outs, row = {}, {"m": m, "gemm": name, "n": n, "k": k}
            for fast in (False, True):
                def f(fast=fast):
                    return torch._scaled_mm(x, w.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16,
                                            use_fast_accum=fast)
                outs[fast] = f().double()
                ms = time_ms(f)
                row[f"{'fast' if fast else 'exact'}_ms"] = round(ms, 4)
                row[f"{'fast' if fast else 'exact'}_tflops"] = round(2 * m * n * k / ms / 1e9, 1)
            # errors relative to the output's rms: against the exact product of the same e4m3 values (float64),
            # and, for scale, that product's own distance from the unquantized bf16 operands' (W8A8's rounding)
            ref = (x.double() * sa.double()) @ (w.double() * sb.double()).t()
            orig = xo.double() @ wo.double().t()
            rms = orig.pow(2).mean().sqrt().item()

            def rel(d):
                return {"max": round(d.abs().max().item() / rms, 6),
                        "rms": round(d.pow(2).mean().sqrt().item() / rms, 6)}
            row["exact_err"], row["fast_err"] = rel(outs[False] - ref), rel(outs[True] - ref)
            row["fast_vs_exact"] = rel(outs[True] - outs[False])
            row["w8a8_rounding_err"] = rel(ref - orig)
            row["fast_over_exact_time"] = round(row["fast_ms"] / row["exact_ms"], 3)
            # for scale: one scale per tensor (static input scales with per-tensor weights could take it), and the
            # bf16 GEMM of the same shape
            one_a, one_b = sa[:1, :1].reshape(()), sb[:1, :1].reshape(())
            for fast in (False, True):
                def g(fast=fast):
                    return torch._scaled_mm(x, w.t(), scale_a=one_a, scale_b=one_b, out_dtype=torch.bfloat16,
                                            use_fast_accum=fast)
                row[f"tensorwise_{'fast' if fast else 'exact'}_ms"] = round(time_ms(g), 4)
            xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
            row["bf16_ms"] = round(time_ms(lambda: xb @ wb.t()), 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                           "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
