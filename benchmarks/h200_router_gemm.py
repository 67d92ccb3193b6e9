"""Time the MoE router's logits on this GPU: the reference path against kernels-triton's split-weight kernel.

    python benchmarks/h200_router_gemm.py --out results.json [--layers 16]
    python benchmarks/h200_router_gemm.py --smoke     # CPU, interpreted, tiny shapes: the script runs

The router computes float32 logits from bf16 activations and a float32 gate (HF computes DeepSeek's router
in float32). Past 8 tokens the `router_gemm` op runs `F.linear(x.float(), w)` (a copy kernel plus cuBLAS's
float32 GEMM on CUDA cores; `keel_kernels_triton.fused_moe.ops.ROUTER_KERNEL_MAX_TOKENS`), because the
kernel's IEEE float32 tl.dot tiles were slower (H200: 46 vs 13 us per DSV2-Lite layer at 256 tokens). The
kernel now splits the gate into three exact bf16 parts and runs three bf16 tensor-core dots (exact
products, float32 sums; router_gemm.py). Per shape (DSV2-Lite: 64 experts x 2048; V3: 256 x 7168) and token
count, each path as a CUDA graph of `--layers` launches over distinct activations (median of 5 replays),
and each path's largest error against a float64 product relative to sum |x| |w|.

Prediction (before any GPU run): DSV2-Lite at 256 tokens ~5 us per layer against ~13 us, at 8192 ~15 us
against ~117 us; if so, ROUTER_KERNEL_MAX_TOKENS goes to every size (a 256-token decode step -0.2 ms, an
8192-token prefill step -2.6 ms of DSV2-Lite's 26 MoE layers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
SHAPES = {"dsv2lite": (64, 2048), "v3": (256, 7168)}
TOKENS = [16, 64, 256, 1024, 2048, 4096, 8192]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    from keel_kernels_triton.fused_moe.router_gemm import router_gemm_triton

    device = "cpu" if args.smoke else "cuda"
    shapes = {"tiny": (12, 40)} if args.smoke else SHAPES
    tokens_list = [9, 20] if args.smoke else TOKENS
    import h200_moe_tiles as tiles

    timer = tiles.wall_ms_per_layer if args.smoke else tiles.graph_ms_per_layer
    layers = 2 if args.smoke else args.layers
    rows = []
    for name, (experts, k) in shapes.items():
        gen = torch.Generator(device=device).manual_seed(experts)
        w = (torch.randn(experts, k, device=device, generator=gen) / k**0.5).float()
        for tokens in tokens_list:
            xs = [torch.randn(tokens, k, device=device, generator=gen).bfloat16() for _ in range(layers)]
            ref = xs[0].double() @ w.double().t()
            scale = xs[0].double().abs() @ w.double().abs().t()
            row = {"shape": name, "experts": experts, "k": k, "tokens": tokens}
            for path, fn in (("reference", lambda x: F.linear(x.float(), w)),
                             ("split_kernel", lambda x: router_gemm_triton(x, w))):
                err = ((fn(xs[0]).double() - ref).abs() / scale.clamp_min(1e-30)).max().item()
                us = timer(lambda i, fn=fn: fn(xs[i]), layers) * 1e3
                row[path] = {"us": us, "max_err_rel_to_sum_abs": err}
            rows.append(row)
            print(f"{name} tokens={tokens:5d}  reference {row['reference']['us']:7.1f} us  "
                  f"split kernel {row['split_kernel']['us']:7.1f} us  "
                  f"errors {row['reference']['max_err_rel_to_sum_abs']:.1e} / "
                  f"{row['split_kernel']['max_err_rel_to_sum_abs']:.1e}")
    result = {"device": "cpu (interpreted smoke run)" if args.smoke else torch.cuda.get_device_name(),
              "commit": os.environ.get("KEEL_COMMIT", ""), "layers": layers,
              "versions": {"torch": torch.__version__}, "results": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
