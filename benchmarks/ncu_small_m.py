"""Decode-size quantized GEMMs for Nsight Compute: what bounds them (DRAM throughput, issue slots, stalls).

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        --section MemoryWorkloadAnalysis -k regex:'gemv_fold|w8a8_small_m' python benchmarks/ncu_small_m.py

Runs Llama-3-8B's four layer shapes at M = 1 through the shipped plans: GPTQ int4 group 128 (gemv_fold) and
the W8A8 small-M GEMM per row (dynamic per-token activations); each GEMM twice over weights larger than L2
(ncu replays a kernel with its caches flushed anyway). No timing here: ncu's numbers are the result.
"""

from __future__ import annotations

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    from keel_quantization import fp8_math
    from keel_quantization.fp8_w8a8_small_m_triton import fp8_w8a8_small_m_gemm
    from keel_quantization.int4_triton import int4_gemm

    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        words = torch.randint(-(1 << 31), 1 << 31, (k // 8, n), device="cuda", generator=gen,
                              dtype=torch.int64).to(torch.int32)
        scales = torch.rand(k // 128, n, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.01
        zeros = torch.full_like(scales, 8.0)
        g_idx = torch.arange(k, device="cuda", dtype=torch.int32) // 128
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
        q, s = fp8_math.quantize_per_row(w)
        del w
        for _ in range(2):
            int4_gemm(x, words, scales, zeros, g_idx, group_size=128)
            fp8_w8a8_small_m_gemm(x, q, s[:, None], 1, k, "dynamic_token")
        torch.cuda.synchronize()
        print(name, n, k, "done", flush=True)


if __name__ == "__main__":
    main()
