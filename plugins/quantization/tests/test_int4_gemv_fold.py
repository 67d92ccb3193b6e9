"""The "gemv_fold" int4 kernel (int4_gemv_fold_triton: zero point folded out of the inner loop), interpreted
on the CPU against a float64 reference on fresh inputs: scale groups of 32 / 64 / 128 and one group over
all of K, symmetric and asymmetric zeros, desc_act g_idx (gathered, unfolded path), M 1-5 (rows past M in
the last M block), N and K off the tile grid (the masked loads), K splits, bf16 activations, NaN-poisoned
outputs (every element written)."""

from __future__ import annotations

import pytest
import torch
from keel_quantization import int4_math
from keel_quantization.int4_linear import tileable_group
from keel_quantization.quantizer_int4 import int4_tensors
from keel_quantization.small_m_plan import SmallMPlan
from quant_test_utils import reference_linear

pytest.importorskip("triton")
int4_triton = pytest.importorskip("keel_quantization.int4_triton")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_quant.py runs it compiled")

# The folded sums: a word's 8 products accumulate onto -(E + O / 16 + z X / 256), |.| <= ~2.2 sum |x_j| for
# its inputs, in ~10 float32 roundings, then scale by 256 s: error <= ~10 * 2.2 * 256 * 2^-24 sum_k |x_k| s_k
# (~3.4e-4 of sum |x| s, the worst case; typically ~100x less). A wrong nibble, zero or scale is off by
# ~s |x| per input.
FOLD_ERROR = 6000 * 2.0**-24


def _case(m: int, k: int, n: int, group: int, sym: bool, desc_act: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tensors, deq = int4_tensors("gptq", "x.weight", torch.randn(n, k, generator=gen), group_size=group,
                                sym=sym, desc_act=desc_act, seed=seed)
    zeros = (int4_math.unpack_cols(tensors["x.qzeros"]) + 1).float()
    x = torch.randn(m, k, generator=gen)
    return x, tensors["x.qweight"], tensors["x.scales"].float(), zeros, tensors["x.g_idx"], deq


def _bound(x: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:  # [M, N]
    return FOLD_ERROR * (x.double().abs() @ scales.double()[g_idx.long()].abs())


PLANS = [SmallMPlan("gemv_fold", 1, 16, 32), SmallMPlan("gemv_fold", 2, 8, 16, split_k=3),
         SmallMPlan("gemv_fold", 4, 16, 16, split_k=2, num_stages=2), SmallMPlan("gemv_fold", 8, 32, 64),
         SmallMPlan("gemv_fold", 1, 8, 32, split_k=3, num_stages=3),  # num_stages: the loop's pipeline depth
         SmallMPlan("gemv_fold", 2, 16, 128, split_k=2)]  # tiles of several groups of 32 / 64


def _id(p: SmallMPlan) -> str:
    return f"{p.block_m}x{p.block_n}x{p.block_k}-s{p.split_k}" + (f"-p{p.num_stages}" if p.num_stages else "")


@pytest.mark.parametrize("plan", PLANS, ids=_id)
@pytest.mark.parametrize("m,k,n,group,sym", [(1, 128, 64, 32, False), (3, 192, 40, 64, True),
                                             (5, 256, 24, 128, False), (2, 72, 56, -1, False)])
def test_fold_matches_the_reference_on_in_order_groups(plan, m, k, n, group, sym):
    x, qw, s, z, g_idx, deq = _case(m, k, n, group, sym, False, seed=m * 1000 + k + n)
    group_size = tileable_group(g_idx, k if group == -1 else group)
    assert group_size > 0
    if group_size < k and group_size % plan.block_k and plan.block_k % group_size:
        pytest.skip(f"BLOCK_K {plan.block_k} neither divides the group {group_size} nor is a multiple of it")
    out = torch.full((m, n), float("nan"))
    int4_triton.int4_gemm(x, qw, s, z, g_idx, out=out, group_size=group_size, plan=plan)
    err = (out.double() - reference_linear(x, deq)).abs()
    assert bool((err <= _bound(x, s, g_idx)).all()), f"max error {err.max():.3g}"


def test_fold_splits_an_uneven_tile_count_as_down_proj_does():
    """small_m_plan's M = 1 plan for Llama-8B's down_proj (1 x 32 x 1024, 8 warps, split 4 over K 14336: 14
    tiles of whole groups in splits of 4 / 4 / 4 / 2), scaled to K tiles of 64."""
    x, qw, s, z, g_idx, deq = _case(1, 14 * 64, 64, 32, False, False, seed=14)
    out = torch.full((1, 64), float("nan"))
    int4_triton.int4_gemm(x, qw, s, z, g_idx, out=out, group_size=32,
                          plan=SmallMPlan("gemv_fold", 1, 32, 64, split_k=4, num_warps=8))
    err = (out.double() - reference_linear(x, deq)).abs()
    assert bool((err <= _bound(x, s, g_idx)).all()), f"max error {err.max():.3g}"


@pytest.mark.parametrize("plan", PLANS[1:3], ids=_id)
def test_fold_gathers_desc_act_groups_exactly(plan):
    """desc_act: no group per tile, so no folding -- (q - z[g]) s[g] per element, float32-exact products."""
    x, qw, s, z, g_idx, deq = _case(5, 96, 40, 32, False, True, seed=7)
    assert tileable_group(g_idx, 32) == 0
    out = torch.full((5, 40), float("nan"))
    int4_triton.int4_gemm(x, qw, s, z, g_idx, out=out, group_size=0, plan=plan)
    torch.testing.assert_close(out.double(), reference_linear(x, deq), rtol=1e-4, atol=1e-4)


def test_fold_in_bf16():
    x, qw, s, z, g_idx, deq = _case(3, 256, 48, 128, False, False, seed=11)
    xb = x.bfloat16()
    out = torch.full((3, 48), float("nan"), dtype=torch.bfloat16)
    int4_triton.int4_gemm(xb, qw, s.half(), z.half(), g_idx, out=out, group_size=128,  # the checkpoint's fp16
                          plan=SmallMPlan("gemv_fold", 4, 16, 64, split_k=2))
    ref = reference_linear(xb, deq)
    torch.testing.assert_close(out.double(), ref, rtol=8e-3, atol=1e-2)  # the bf16 output's rounding


def test_fp8_refuses_the_int4_kernel():
    from keel_quantization import fp8_math, fp8_triton

    q, s = fp8_math.quantize_per_row(torch.randn(16, 32))
    with pytest.raises(ValueError, match="gemv_fold kernel is int4 only"):
        fp8_triton.fp8_weight_only_gemm(torch.randn(2, 32), q, s.reshape(-1, 1), 1, 32,
                                        plan=SmallMPlan("gemv_fold", 2, 16, 16))


def test_tables_take_gemv_fold_tiles_of_whole_groups():
    """A K tile must lie in one scale group -- or, for gemv_fold only, hold whole groups."""
    from keel_quantization import small_m_plan

    fold, dot = SmallMPlan("gemv_fold", 1, 32, 512), SmallMPlan("dot", 16, 64, 512)
    try:
        small_m_plan.use_tables({"int4": ((1, fold), (2, dot))})
        assert small_m_plan.int4_plan(1, 4096, 4096, 128) == fold
        assert small_m_plan.int4_plan(2, 4096, 4096, 128).block_k == 128  # the default: 512 spans groups
        assert small_m_plan.int4_plan(1, 4096, 4096, 96) != fold  # 512 is no multiple of 96
    finally:
        small_m_plan.use_shipped()
    x, qw, s, z, g_idx, _ = _case(1, 128, 16, 32, False, False, seed=3)
    with pytest.raises(ValueError, match="for gemv_fold, a multiple of it"):
        int4_triton.int4_gemm(x, qw, s, z, g_idx, group_size=32, plan=SmallMPlan("gemv_fold", 1, 16, 48))


def test_long_k_splits_gemv_fold_programs():
    """A gemv_fold program covers at most FOLD_MAX_K_PER_SPLIT inputs (Llama-8B's down_proj at M = 1: split
    in 2), a measured split that already fits is kept, and other kernels' plans are left alone."""
    from keel_quantization import small_m_plan

    cap = small_m_plan.FOLD_MAX_K_PER_SPLIT
    one = small_m_plan.int4_plan(1, 4096, 14336, 128)
    assert one.kernel == "gemv_fold" and -(-14336 // one.split_k) <= cap < 14336
    assert small_m_plan.int4_plan(1, 4096, 4096, 128).split_k == 1
    assert small_m_plan.int4_plan(2, 4096, 14336, 128).split_k == 2  # the table's own split fits
    assert small_m_plan.int4_plan(16, 4096, 14336, 128).kernel == "dot"
