"""An int4 GEMM candidate for steps of 64-8192 tokens (GPTQ / AWQ, group 128 in order) at Llama-3-8B's layer
shapes, against the shipped paths: each K tile's weights dequantized in the layout they are loaded in,
((2^23 + q) - (2^23 + z)) * s in float32, rounded once to bf16 (the dequantize pass's numbers), then one
wgmma into a float32 accumulator that is never rescaled.

Why (sm_90 SASS of Triton 3.6, compiled without a GPU: `triton.compile` of an ASTSource for
GPUTarget("cuda", 90, 32), then cuobjdump -sass on the cubin, counting the main loop's instructions): the
shipped GEMM (`int4_triton`, 128 x 128 x 64, 8 warps) is bound by issue against 512 clocks of wgmma work a
tile. The prediction below came from a first count with the strides left unspecialized (909 vs 496
instructions a tile); specialized as the JIT launches it (unit strides constant, the rest divisible by 16)
the counts are 471 shipped vs 322 here (1.46x). Prediction: 128 x 256 x 64 at ~0.6-0.8x bf16 cuBLAS from
M = 1024, ~2x the shipped GEMM at every M; against dequantize + cuBLAS it should win below ~512 tokens (no
2.5-byte-a-weight pass). Outcome at 3f73831 (h200-int4-wdeq-3f73831.json): 1.4-1.8x the shipped GEMM from
M = 256, level below; 0.48x cuBLAS at 8192; behind dequantize + cuBLAS at every M from 256. Not adopted.

    python benchmarks/h200_int4_wdeq.py --out benchmarks/results/h200-int4-wdeq.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

_here = Path(__file__).resolve().parent
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = (64, 128, 256, 512, 1024, 2048, 8192)
TILES = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4),
         (64, 256, 64, 4, 3), (64, 128, 64, 4, 4), (128, 128, 128, 8, 3), (256, 128, 64, 8, 3)]


@triton.jit
def _wdeq_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, M, N, K,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_ym, stride_yn,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n  # programs of GROUP_M M blocks walk N together: each weight tile read ~once from HBM
    first_m = (pid // width) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=mask_m[:, None],
                    other=0.0)  # [BM, BK]
        words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(qw_ptr + words[:, None] * stride_qk + offs_n[None, :] * stride_qn)  # [BK / 8, BN]
        sz = (k0 // GROUP) * stride_sg + offs_n
        s = tl.load(s_ptr + sz).to(tl.float32)[None, None, :]
        zb = tl.load(z_ptr + sz).to(tl.float32)[None, None, :] + 8388608.0  # 2^23 + z
        q = (((packed[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF) | 0x4B000000).to(
            tl.float32, bitcast=True)  # [BK / 8, 8, BN] 2^23 + q
        w = tl.reshape(((q - zb) * s).to(x_ptr.dtype.element_ty), (BLOCK_K, BLOCK_N))
        acc = tl.dot(x, w, acc)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None])


def wdeq_gemm(x, qw, s, z, tile, out=None):
    m, k = x.shape
    n = qw.shape[1]
    bm, bn, bk, warps, stages = tile
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _wdeq_kernel[grid](x, qw, s, z, y, m, n, k, x.stride(0), x.stride(1), qw.stride(0), qw.stride(1), s.stride(0),
                       y.stride(0), y.stride(1), GROUP=128, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                       num_warps=warps, num_stages=stages)
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/h200-int4-wdeq.json")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ns = ap.parse_args()
    from keel.bench import source_commit
    from keel.testing.scripts import load_script
    from keel_quantization.int4_dequant_triton import int4_dequantize
    from keel_quantization.int4_triton import int4_gemm

    llama = load_script(_here / "h200_llama8b.py")
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = {}
    for name, (n, k) in SHAPES.items():
        words = torch.randint(-(1 << 31), 1 << 31, (k // 8, n), device="cuda", generator=gen, dtype=torch.int64)
        s = torch.rand(k // 128, n, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.01
        z = torch.randint(0, 16, (k // 128, n), device="cuda", generator=gen).to(torch.bfloat16)
        layers[name] = (words.to(torch.int32), s, z, torch.arange(k, device="cuda", dtype=torch.int32) // 128)
    rows = []
    for m in (int(v) for v in ns.ms.split(",")):
        for name, (n, k) in SHAPES.items():
            qw, s, z, g = layers[name]
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            dense = int4_dequantize(qw, s, z, g, torch.bfloat16, 128)
            ref = (x.double() @ dense.double())
            fns = {"shipped": lambda: int4_gemm(x, qw, s, z, g, group_size=128),
                   "dequant_cublas": lambda: x @ int4_dequantize(qw, s, z, g, torch.bfloat16, 128),
                   "bf16_cublas": lambda: x @ dense}
            for t in TILES:
                fns["wdeq_" + "x".join(map(str, t[:3])) + f"_w{t[3]}s{t[4]}"] = lambda t=t: wdeq_gemm(x, qw, s, z, t)
            row = {"m": m, "layer": name, "us": {}, "max_rel_err": {}}
            scale = ref.abs().max().item()
            for label, fn in fns.items():
                try:
                    y = fn()
                    row["max_rel_err"][label] = ((y.double() - ref).abs().max() / scale).item()
                    row["us"][label] = llama._events_ms(fn, iters=10) * 1000
                except Exception as e:  # a tile that does not compile or fit is a result
                    row["us"][label] = None
                    row.setdefault("errors", {})[label] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(json.dumps({"m": m, "layer": name, "us": row["us"]}, default=lambda v: round(v, 1)), flush=True)
    totals = {}
    for r in rows:
        t = totals.setdefault(r["m"], {})
        for lb, us in r["us"].items():
            t[lb] = None if us is None or t.get(lb, 0) is None else t.get(lb, 0) + us
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": source_commit(_here) or "unknown", "rows": rows, "us_per_four_layers": totals}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=1, default=float))
    for m, t in totals.items():
        best = min((us, lb) for lb, us in t.items() if us is not None and lb.startswith("wdeq"))
        print(m, {lb: round(t[lb], 1) for lb in ("shipped", "dequant_cublas", "bf16_cublas")}, "best wdeq", best[1],
              round(best[0], 1))


if __name__ == "__main__":
    main()
