"""The int4 fused-MoE grouped GEMM under the Triton interpreter, against the torch reference on the
dequantized experts (float32): GPTQ-packed, asymmetric, a shuffled g_idx as desc_act writes, idle
experts. Block-FP8 experts run the unquantized kernel's fp8 mode (test_moe_fp8_block.py)."""

from __future__ import annotations

import pytest
import torch
from keel_kernels_triton.fused_moe.quant_gemm import fused_experts_quant_triton
from keel_kernels_triton.fused_moe.tile_config import MoETileConfig
from triton_test_utils import random_moe

from keel.layers.fused_moe import fused_experts_torch
from keel.layers.fused_moe.quant_config import FusedMoEQuantConfig

int4_math = pytest.importorskip("keel_quantization.int4_math")

pytestmark = pytest.mark.usefixtures("interpret")

TILES = MoETileConfig(16, 32, 32, 4, 1)


def int4_experts(w: torch.Tensor, group: int, seed: int):
    """[E, N, K] float -> (qweight [E, K/8, N], scales, zeros [E, G, N], g_idx [E, K], dequantized [E, N, K])."""
    gen = torch.Generator().manual_seed(seed)
    e, n, k = w.shape
    groups = k // group
    q = torch.randint(0, 16, (e, k, n), generator=gen)
    zeros = torch.randint(1, 16, (e, groups, n), generator=gen).float()
    scales = torch.rand(e, groups, n, generator=gen) * 0.05 + 0.01
    g_idx = torch.stack([(torch.arange(k) // group)[torch.randperm(k, generator=gen)] for _ in range(e)]).int()
    packed = torch.stack([int4_math.pack_rows(qe) for qe in q])
    deq = torch.stack([int4_math.dequantize_int4(q[i], zeros[i], scales[i], g_idx[i], torch.float32).T
                       for i in range(e)])
    return packed, scales, zeros, g_idx, deq


def test_int4_experts_match_the_reference():
    x, w13, w2, w, ids = random_moe(3, 7, 48, 24, 5, 2, used=[0, 1, 3])
    p13, s13, z13, g13, d13 = int4_experts(w13, 16, 1)
    p2, s2, z2, g2, d2 = int4_experts(w2, 8, 2)
    quant = FusedMoEQuantConfig("int4", s13, s2, w13_zeros=z13, w2_zeros=z2, w13_g_idx=g13, w2_g_idx=g2)
    ref = fused_experts_torch(x, w13, w2, w, ids, expert_weights=lambda e: (d13[e], d2[e]))
    out = fused_experts_quant_triton(x, p13, p2, w, ids, "silu", None, quant, tile_configs=(TILES, TILES))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
