"""DeepSeek-V2-Lite's MoE block on this GPU: router and shared experts as on main vs fused.

    python benchmarks/h200_dsv2_moe_block.py [--out results.json] [--layers 8] [--tokens 1,2,4,...]

Shapes of DeepSeek-V2-Lite (64 routed experts, top-6, 2 shared experts of intermediate 1408, hidden 2048,
bf16; the router in float32). Per token count each variant runs the whole MoE block after the
post-attention norm -- router logits, routing, shared experts, routed experts, combine -- over `--layers`
distinct weight copies inside one CUDA graph; per-layer time = median replay / layers. Variants:

  separate      main before: F.linear(x.float(), W) (a copy + cuBLAS fp32 GEMM), the routing kernel, the
                shared MLP (cuBLAS gate_up, silu_and_mul, cuBLAS down), fused experts (E=64) + residual
  router_gemm   the same with kernels-triton's router_gemm (one launch, no float32 copy of x)
  fused         router_gemm, routing appending experts 64 and 65 (weight 1), fused experts over E=66 with
                the tiles the engine looks up for E=66 (what a step runs now)
  fused_e64     the same with E=64's tuned tiles passed explicitly (a lookup falling back to E=64's file)

The engine runs `fused` up to `FUSED_SHARED_MAX_TOKENS` tokens (keel/layers/fused_moe/layer.py, 32) and
`router_gemm`'s shape past it (routed-only routing, the shared experts as dense GEMMs over the fused
slots); the crossover of `fused` and `router_gemm` here is where that constant belongs.

Printed per variant: ms per layer, speedup over `separate`, the largest deviation from `separate`'s output
(bf16 rounding of a different summation order), and the tiles. The shared weights of `separate` are the
fused experts 64 and 65 re-stacked, so outputs compare.

Prediction (written before any device run): the router alone saves a copy and replaces the fp32 GEMM,
~2.5 us per layer at 1 token (of ~6.5 us), ~9 us at 256, most at 8192 (~110 us -> ~35 us). Fusing the
shared experts removes 3 launches (~12 us at 1 token) and adds 2 experts to the grouped GEMM, which runs
at ~43% of copy bandwidth with 6 experts at 1 token and better with more experts in flight: with E=64's
tiles ~-6 us per layer at 1 token (fused_e64 ~0.85x separate's time), about even from 16 to 256 tokens.
With the heuristic tiles for E=66 (no tuned file: split-K 4 at <= 16 tokens, measured 0.2-0.4x) `fused` is
slower at decode sizes until the lookup falls back to E=64's tuned file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from keel_kernels_triton.fused_moe.grouped_gemm import fused_experts_triton
from keel_kernels_triton.fused_moe.router_gemm import router_gemm_triton
from keel_kernels_triton.fused_moe.routing import select_experts_triton
from keel_kernels_triton.fused_moe.tile_config import get_moe_tile_configs
from keel_kernels_triton.ops import TritonSiluAndMul

from keel.layers.fused_moe import RoutingConfig

sys.path.insert(0, str(Path(__file__).parent))
import h200_moe_tiles as sweep  # noqa: E402  (the tile sweep's CUDA-graph timing)

E, SHARED, HIDDEN, INTER, TOP_K = 64, 2, 2048, 1408, 6
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 8192]
ROUTED = RoutingConfig(num_experts=E, top_k=TOP_K)  # DeepSeek-V2-Lite: softmax greedy, no renormalization
FUSED = RoutingConfig(num_experts=E, top_k=TOP_K, num_fused_shared_experts=SHARED)
SILU = TritonSiluAndMul()


class Layer:
    """One MoE layer's weights: the fused stack [E + SHARED, ...] and the shared MLP re-stacked from it."""

    def __init__(self) -> None:
        self.gate = torch.randn(E, HIDDEN, device="cuda") / HIDDEN**0.5
        self.w13 = torch.empty(E + SHARED, 2 * INTER, HIDDEN, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02)
        self.w2 = torch.empty(E + SHARED, HIDDEN, INTER, dtype=torch.bfloat16, device="cuda").normal_(0, 0.03)
        shared = range(E, E + SHARED)
        # the separate MLP: gate rows of every shared expert, then up rows; down columns in the same order
        self.gate_up = torch.cat([self.w13[s, :INTER] for s in shared] + [self.w13[s, INTER:] for s in shared])
        self.down = torch.cat([self.w2[s] for s in shared], dim=1).contiguous()


def block(variant: str, x: torch.Tensor, layer: Layer, tiles) -> torch.Tensor:
    if variant in ("separate", "router_gemm"):
        logits = F.linear(x.float(), layer.gate) if variant == "separate" else router_gemm_triton(x, layer.gate)
        w, ids = select_experts_triton(logits, ROUTED)
        shared = F.linear(SILU(F.linear(x, layer.gate_up)), layer.down)
        return fused_experts_triton(x, layer.w13[:E], layer.w2[:E], w, ids, "silu", shared, tile_configs=tiles)
    w, ids = select_experts_triton(router_gemm_triton(x, layer.gate), FUSED)
    return fused_experts_triton(x, layer.w13, layer.w2, w, ids, "silu", None, tile_configs=tiles)


def tiles_for(variant: str, tokens: int):
    routes = TOP_K + (SHARED if variant.startswith("fused") else 0)
    experts = E + SHARED if variant == "fused" else E
    return get_moe_tile_configs(tokens, (experts, 2 * INTER, HIDDEN), (experts, HIDDEN, INTER), routes,
                                torch.bfloat16, torch.device("cuda"), False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    ap.add_argument("--layers", type=int, default=8, help="distinct weight copies per timed graph")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    torch.manual_seed(0)
    layers = [Layer() for _ in range(args.layers)]
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
        row = {"tokens": tokens, "variants": {}}
        ref = None
        for variant in ("separate", "router_gemm", "fused", "fused_e64"):
            tiles = tiles_for(variant, tokens)
            try:
                out = block(variant, x, layers[0], tiles).clone()  # compiles outside the capture
                n = len(layers) if tokens <= 1024 else min(len(layers), 2)  # prefill sizes: bounded memory
                ms = sweep.graph_ms_per_layer(lambda i, v=variant, t=tiles: block(v, x, layers[i], t), n, reps=7)
            except Exception as e:  # noqa: BLE001 - a failing variant is reported, the rest still run
                row["variants"][variant] = sweep.variant_failed(f"M={tokens:5d} {variant:11s}", e)
                continue
            ref = out if ref is None else ref
            dev = sweep.max_rel_dev(out, ref)
            base = row["variants"].get("separate", {}).get("ms", ms)
            row["variants"][variant] = {"ms": ms, "speedup_vs_separate": base / ms, "max_rel_dev": dev,
                                        "tiles": [t.to_json() for t in tiles]}
            print(f"M={tokens:5d} {variant:11s} {ms * 1e3:8.1f} us/layer  {base / ms:5.2f}x  dev {dev:.1e}  "
                  f"tiles {[t.to_json() for t in tiles]}", flush=True)
        results.append(row)
    if args.out is not None:
        args.out.write_text(json.dumps({"device": device, "layers": args.layers, "shape": {
            "experts": E, "shared": SHARED, "hidden": HIDDEN, "moe_intermediate": INTER, "top_k": TOP_K},
            "results": results}, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
