"""FP8 activation quantization (`keel_quantization.fp8_quant_triton.quant_fp8`) per launch variant, on the
inputs of Llama-3-8B's linear layers (K 4096: qkv / o / gate_up; K 14336: down) at decode and prefill M.

    python benchmarks/h200_fp8_act_quant.py --out benchmarks/results/h200-fp8-act-quant.json

In the per-tensor fp8 Llama engine at fa4e9f7 the 128 launches a step took 14.7 ms of a 121 ms 8192-token
prefill step (~35% of copy bandwidth) and 0.71 ms of a 7.5 ms batch-256 decode step. Times are CUDA-graph
replays (20 calls on one input: a decode-size input stays in L2 as it does after the kernel that wrote it).
Per row: microseconds and GB/s (bf16 in, e4m3 + float32 scales out) per variant, the variant
`choose_launch` takes, and whether every variant's output equals the default's bit for bit. ~20 s on an H200.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

MS = (64, 256, 1024, 8192)
KS = (4096, 14336)


def variants(group_is_k: bool) -> dict:
    from keel_quantization.fp8_quant_triton import QuantLaunch

    out = {"tile": QuantLaunch(), "tile_w16": QuantLaunch("tile", 16)}
    if group_is_k:
        for chunk in (1024, 2048, 4096):
            for warps in (4, 8):
                out[f"loop_c{chunk}_w{warps}"] = QuantLaunch("loop", warps, chunk)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/h200-fp8-act-quant.json")
    ns = ap.parse_args()
    import triton
    from keel_quantization.fp8_quant_triton import choose_launch, quant_fp8

    from keel.bench import source_commit

    from h200_quant import graph_us  # benchmarks/ is on sys.path when this script runs
    gen = torch.Generator(device="cuda").manual_seed(0)
    start = time.perf_counter()
    rows = []
    for k in KS:
        for group in (k, 128):
            for m in MS:
                x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
                groups = -(-k // group)
                moved = m * k * 3 + m * groups * 4
                ref = quant_fp8(x, group)
                row = {"m": m, "k": k, "group": group, "chosen": str(choose_launch(m, k, group))}
                for name, launch in variants(group >= k).items():
                    got = quant_fp8(x, group, launch=launch)
                    us = graph_us(lambda i, launch=launch: quant_fp8(x, group, launch=launch), 20)
                    row[f"{name}_us"] = us
                    row[f"{name}_GBps"] = moved / us / 1e3
                    row[f"{name}_bit_equal"] = bool(torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8))
                                                    and torch.equal(got[1], ref[1]))
                rows.append(row)
                print(json.dumps({kk: round(v, 1) if isinstance(v, float) else v for kk, v in row.items()
                                  if not kk.endswith("_GBps")}), flush=True)
    commit = source_commit(Path(__file__).parent)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": commit, "rows": rows, "wall_s": time.perf_counter() - start}
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
