"""The quantized fused-MoE grouped GEMMs under the Triton interpreter, against the torch reference on the
dequantized experts (float32): block FP8 (W8A8, per-token-group activations; a partial last K group, a
hidden size of 40 in 16-wide groups) and int4 (GPTQ-packed, asymmetric, a shuffled g_idx as desc_act
writes), idle experts, and an output buffer poisoned with NaN that every live row must overwrite."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from keel_kernels_triton.fused_moe.align import moe_align_block_size
from keel_kernels_triton.fused_moe.quant_gemm import fused_experts_quant_triton, invoke_fused_moe_quant_kernel
from keel_kernels_triton.fused_moe.tile_config import MoETileConfig
from triton_test_utils import random_moe

from keel.layers.fp8_utils import dequant_per_token_group, per_token_group_quant_fp8
from keel.layers.fused_moe import fused_experts_torch
from keel.layers.fused_moe.quant_config import FusedMoEQuantConfig

fp8_math = pytest.importorskip("keel_quantization.fp8_math")
int4_math = pytest.importorskip("keel_quantization.int4_math")

pytestmark = pytest.mark.usefixtures("interpret")

BLOCK = (16, 16)
TILES = MoETileConfig(16, 32, 32, 4, 1)  # block_k 32 is capped at the 16-wide scale group


def fp8_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[E, N, K] float -> (fp8, block scales, dequantized float32)."""
    qs = [fp8_math.quantize_blocks(we, BLOCK) for we in w]
    q, s = torch.stack([a for a, _ in qs]), torch.stack([b for _, b in qs])
    deq = torch.stack([fp8_math.dequantize(a, b, BLOCK, torch.float32) for a, b in qs])
    return q, s, deq


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


def fp8_case(seed: int, tokens: int, hidden: int, inter: int, experts: int, top_k: int, used=None):
    x, w13, w2, w, ids = random_moe(seed, tokens, hidden, inter, experts, top_k, used=used)
    q13, s13, d13 = fp8_experts(w13)
    q2, s2, d2 = fp8_experts(w2)
    quant = FusedMoEQuantConfig("fp8_block", s13, s2, block_shape=BLOCK)
    ref = fused_experts_torch(x, w13, w2, w, ids, expert_weights=lambda e: (d13[e], d2[e]),
                              quantize_input=lambda t: fp8_math.fake_quant_per_token_group(t, BLOCK[1]))
    return x, q13, q2, w, ids, quant, ref


@pytest.mark.parametrize("tokens,top_k,used,fused_quant", [(1, 2, None, ""), (9, 3, [0, 2, 5], ""),
                                                           (9, 3, None, "input"), (9, 3, None, "gated")])
def test_block_fp8_experts_match_the_reference(tokens, top_k, used, fused_quant):
    x, q13, q2, w, ids, quant, ref = fp8_case(tokens, tokens, 40, 32, 6, top_k, used)
    calls, gated = [], []
    if fused_quant:  # the quantization plugin's one-launch quantizers, as its method hands them over on a GPU
        quant_fp8 = pytest.importorskip("keel_quantization.fp8_quant_triton").quant_fp8
        quant = dataclasses.replace(quant, quantize_input=lambda t, g: calls.append(t.shape) or quant_fp8(t, g))
    if fused_quant == "gated":  # silu(gate) * up and its quantization in one launch
        fused = pytest.importorskip("keel_quantization.fp8_input_fusion_triton")
        quant = dataclasses.replace(quant, quantize_gated_input=lambda t, g: gated.append((t.shape, g)) or
                                    fused.silu_and_mul_quant(t, None, group=g))
    residual = torch.randn_like(x)
    out = fused_experts_quant_triton(x, q13, q2, w, ids, "silu", residual, quant, tile_configs=(TILES, TILES))
    torch.testing.assert_close(out, ref + residual, atol=1e-4, rtol=1e-4)
    if fused_quant == "input":
        assert calls == [(tokens, 40), (tokens * top_k, 32)]  # both GEMM inputs
    if fused_quant == "gated":  # the first GEMM's input alone; the down GEMM's comes with its silu
        assert calls == [(tokens, 40)] and gated == [((tokens * top_k, 64), BLOCK[1])]



def test_int4_experts_match_the_reference():
    x, w13, w2, w, ids = random_moe(3, 7, 48, 24, 5, 2, used=[0, 1, 3])
    p13, s13, z13, g13, d13 = int4_experts(w13, 16, 1)
    p2, s2, z2, g2, d2 = int4_experts(w2, 8, 2)
    quant = FusedMoEQuantConfig("int4", s13, s2, w13_zeros=z13, w2_zeros=z2, w13_g_idx=g13, w2_g_idx=g2)
    ref = fused_experts_torch(x, w13, w2, w, ids, expert_weights=lambda e: (d13[e], d2[e]))
    out = fused_experts_quant_triton(x, p13, p2, w, ids, "silu", None, quant, tile_configs=(TILES, TILES))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_fp8_gemm_writes_every_live_row_of_a_poisoned_buffer():
    x, q13, _, _, ids, quant, _ = fp8_case(4, 5, 40, 32, 4, 2)
    sorted_ids, expert_ids, total = moe_align_block_size(ids, 4, TILES.block_m)
    c = torch.full((10, 64), float("nan"))
    xq, xs = per_token_group_quant_fp8(x, BLOCK[1])
    invoke_fused_moe_quant_kernel(xq, xs, q13, quant.w13_scale, None, None, c, None, sorted_ids, expert_ids, total,
                                  2, TILES, quant)
    xd = dequant_per_token_group(xq, xs, BLOCK[1], torch.float32)
    w = torch.stack([fp8_math.dequantize(q, s, BLOCK, torch.float32) for q, s in zip(q13, quant.w13_scale)])
    ref = torch.einsum("tk,tnk->tn", xd.repeat_interleave(2, 0).double(), w[ids.reshape(-1)].double())
    assert not c.isnan().any()
    torch.testing.assert_close(c.double(), ref, atol=1e-4, rtol=1e-4)
