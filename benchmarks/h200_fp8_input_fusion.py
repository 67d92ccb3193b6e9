"""fp8 activation quantization fused into its producer (`keel_quantization.fp8_input_fusion_triton`) against the
unfused pair (kernels-triton's norm / silu kernel, then `quant_fp8`), at Llama-3-8B's widths (norm 4096 with the
residual add, SiluAndMul 2 x 14336) and decode / prefill M; for the fused SiluAndMul each launch variant (the row
whole or walked in chunks twice, warps); with --groups block fp8's (128-input groups, cuBLAS's layout) per launch
variant at Llama-3-8B's and DeepSeek-V3's widths.

    python benchmarks/h200_fp8_input_fusion.py --out benchmarks/results/h200-fp8-input-fusion.json

Why: in the engine's 8192-token prefill step on an H100 at 56d12d9 the fused SiluAndMul took 13.9 ms over 32
launches against the unfused pair's 13.6 (the fused norm 6.0 against 9.7). Times are CUDA-graph replays (20 calls
on one input: a decode-size input stays in L2 as it does after the GEMM that wrote it); every variant's output is
checked bit for bit against the unfused pair's. ~30 s.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

MS = (64, 256, 1024, 8192)
HIDDEN, INTER = 4096, 14336
SILU_VARIANTS = ((16384, 8), (16384, 16), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8), (4096, 16))


GROUP_WIDTHS = (4096, 7168)  # Llama-3-8B's, DeepSeek-V3's hidden sizes
NORM_CHUNKS = (512, 1024, 2048, 4096, 8192)  # at 1b41e57 also the whole row through a reshape: 4-5x slower
SILU_GROUP_VARIANTS = ((512, 2), (512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8))


def group_rows(gen, norm, silu, fused, graph_us, same) -> list[dict]:
    """Block fp8 (one scale per 128 inputs, written in cuBLAS's block-scaled layout as the engine's large-M steps
    do) per launch variant against the unfused pair (the norm / silu kernel, then `quantize_activations`)."""
    from keel_quantization.fp8_cublas_block import quantize_activations

    rows = []
    for m in (256, 8192):
        for hidden in GROUP_WIDTHS:
            x, r, w = norm_inputs(m, hidden, gen)

            def unfused(i):
                out, res = norm(x, r, w, 1e-5)
                return (*quantize_activations(out), res)

            want = unfused(0)
            row = {"op": "rms_norm_group128", "m": m, "width": hidden, "unfused_us": graph_us(unfused, 20),
                   "bit_equal": True}
            for chunk in NORM_CHUNKS:
                if chunk > triton_next_pow2(hidden):
                    continue
                fn = lambda i, c=chunk: fused.rms_norm_quant(x, r, w, 1e-5, None, 128, 4, chunk=c)  # noqa: E731
                row[f"chunk{chunk}_us"] = graph_us(fn, 20)
                row["bit_equal"] &= same(fn(0), want)
            rows.append(row)
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        g = torch.randn(m, 2 * INTER, device="cuda", generator=gen, dtype=torch.bfloat16) * 3
        want = quantize_activations(silu(g))
        row = {"op": "silu_and_mul_group128", "m": m, "width": INTER,
               "unfused_us": graph_us(lambda i: quantize_activations(silu(g)), 20), "bit_equal": True}
        for chunk, warps in SILU_GROUP_VARIANTS:
            fn = lambda i, c=chunk, wp=warps: fused.silu_and_mul_quant(g, None, c, wp, 128, 4)  # noqa: E731
            row[f"c{chunk}_w{warps}_us"] = graph_us(fn, 20)
            row["bit_equal"] &= same(fn(0), want)
        rows.append(row)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return rows


def norm_inputs(m: int, width: int, gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A norm's input, residual and weight (bf16 on the GPU), drawn from `gen`."""
    x = torch.randn(m, width, device="cuda", generator=gen, dtype=torch.bfloat16)
    r = torch.randn(m, width, device="cuda", generator=gen, dtype=torch.bfloat16)
    return x, r, torch.rand(width, device="cuda", generator=gen).to(torch.bfloat16)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/h200-fp8-input-fusion.json")
    ap.add_argument("--groups", action="store_true", help="also block fp8's kernels (128-input groups, cuBLAS's "
                    "layout) per launch variant")
    ns = ap.parse_args()
    import triton
    from keel_kernels_triton.ops import TritonFusedAddRMSNorm, TritonSiluAndMul
    from keel_quantization import fp8_input_fusion_triton as fused
    from keel_quantization.fp8_quant_triton import quant_fp8

    from keel.bench import source_commit

    from h200_quant import graph_us  # benchmarks/ is on sys.path when this script runs

    def same(a, b) -> bool:
        return all(torch.equal(x.view(torch.uint8) if x.dtype.itemsize == 1 else x, y.view(torch.uint8)
                               if y.dtype.itemsize == 1 else y) for x, y in zip(a, b))

    gen = torch.Generator(device="cuda").manual_seed(0)
    start = time.perf_counter()
    rows = []
    norm, silu = TritonFusedAddRMSNorm(), TritonSiluAndMul()
    for m in MS:
        x, r, w = norm_inputs(m, HIDDEN, gen)

        def unfused_norm(i):
            out, res = norm(x, r, w, 1e-5)
            return (*quant_fp8(out, HIDDEN), res)

        want = unfused_norm(0)
        row = {"op": "rms_norm", "m": m, "width": HIDDEN,
               "unfused_us": graph_us(unfused_norm, 20),
               "fused_us": graph_us(lambda i: fused.rms_norm_quant(x, r, w, 1e-5, None), 20),
               "bit_equal": same(fused.rms_norm_quant(x, r, w, 1e-5, None), want)}
        rows.append(row)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)

        g = torch.randn(m, 2 * INTER, device="cuda", generator=gen, dtype=torch.bfloat16) * 3
        want = quant_fp8(silu(g), INTER)
        row = {"op": "silu_and_mul", "m": m, "width": INTER, "default": list(fused.silu_launch(m, INTER)),
               "unfused_us": graph_us(lambda i: quant_fp8(silu(g), INTER), 20), "bit_equal": True}
        for chunk, warps in SILU_VARIANTS:
            name = f"c{chunk}_w{warps}"
            row[f"{name}_us"] = graph_us(lambda i, c=chunk, wp=warps: fused.silu_and_mul_quant(g, None, c, wp), 20)
            row["bit_equal"] &= same(fused.silu_and_mul_quant(g, None, chunk, warps), want)
        rows.append(row)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if ns.groups:
        rows += group_rows(gen, norm, silu, fused, graph_us, same)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": source_commit(Path(__file__).parent), "rows": rows, "wall_s": time.perf_counter() - start}
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
