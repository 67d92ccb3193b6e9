"""torch._scaled_mm (row-wise scales, the engine's large-M W8A8 path) with and without `use_fast_accum`, at
Llama-3-8B's projection shapes and M 1024 / 8192: ms per GEMM, TFLOPS, and how far the fast accumulation's output
is from the exact one (relative to the output's scale); for scale, also one scale per tensor (exact / fast) and
the bf16 GEMM. vLLM's CUTLASS W8A8 kernel for M > 128 on sm_90 uses the FP8 fast-accumulation schedule
(KernelTmaWarpSpecializedPingpongFP8FastAccum); keel's calls do not (fp8_native.FAST_ACCUM).

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
            x = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
            w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
            sa = torch.rand(m, 1, device="cuda") * 0.01 + 0.01
            sb = torch.rand(1, n, device="cuda") * 0.01 + 0.01
            outs, row = {}, {"m": m, "gemm": name, "n": n, "k": k}
            for fast in (False, True):
                def f(fast=fast):
                    return torch._scaled_mm(x, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                            use_fast_accum=fast)
                outs[fast] = f().float()
                ms = time_ms(f)
                row[f"{'fast' if fast else 'exact'}_ms"] = round(ms, 4)
                row[f"{'fast' if fast else 'exact'}_tflops"] = round(2 * m * n * k / ms / 1e9, 1)
            ref = (x.float() * sa) @ (w.float() * sb).t()
            scale = ref.abs().mean().item()
            row["exact_err_rel"] = round((outs[False] - ref).abs().max().item() / scale, 5)
            row["fast_err_rel"] = round((outs[True] - ref).abs().max().item() / scale, 5)
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
