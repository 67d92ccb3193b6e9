"""The Triton FP8 GEMMs (interpreted on the CPU; compiled on a GPU) against a float64 reference on the
dequantized operands: W8A8 with block scales with partial edge blocks (N = 24, K = 40 in 16 x 16 blocks)
and one group per row (per-channel weights, per-token activations); weight-only (model-dtype activations,
small M) with block and per-row scales; fresh inputs and a NaN-poisoned output buffer."""

from __future__ import annotations

import pytest
import torch
from keel_quantization import fp8_math

from keel.layers.fp8_utils import dequant_per_token_group, per_token_group_quant_fp8

pytest.importorskip("triton")
fp8_triton = pytest.importorskip("keel_quantization.fp8_triton")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_quant.py runs it compiled")


def operands(m: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5


@pytest.mark.parametrize("m", [1, 5, 19])
def test_block_fp8_gemm_matches_the_reference(m):
    x, w = operands(m, 24, 40, m)
    a_q, a_s = per_token_group_quant_fp8(x, 16)
    b_q, b_s = fp8_math.quantize_blocks(w, (16, 16))
    out = torch.full((m, 24), float("nan"))
    fp8_triton.fp8_gemm(a_q, a_s, b_q, b_s, 16, 16, torch.float32, tiles=(16, 16, 16), out=out)
    ref = dequant_per_token_group(a_q, a_s, 16, torch.float64) @ fp8_math.dequantize(b_q, b_s, (16, 16),
                                                                                      torch.float64).T
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


def test_per_channel_fp8_gemm_is_one_group_per_row():
    x, w = operands(6, 32, 40, 7)
    a_q, a_s = per_token_group_quant_fp8(x, 40)
    b_q, b_s = fp8_math.quantize_per_row(w)
    out = fp8_triton.fp8_gemm(a_q, a_s, b_q, b_s.reshape(-1, 1), 1, 40, torch.float32, tiles=(16, 16, 16))
    ref = (a_q.double() * a_s.double()) @ (b_q.double() * b_s.double()[:, None]).T
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("a_scaled", [True, False], ids=["w8a8", "weight_only"])
@pytest.mark.parametrize("split", [1, 3])
def test_per_row_scales_after_the_loop_match_the_reference(a_scaled, split):
    from keel_quantization.small_m_plan import SmallMPlan

    m, n, k = 19, 40, 96  # partial token and weight-row tiles; 6 K tiles of 16, split 3 ways
    x, w = operands(m, n, k, 11 + split)
    b_q, b_s = fp8_math.quantize_per_row(w)
    b_s = b_s.reshape(-1, 1)
    plan = SmallMPlan("dot", 16, 16, 16, split)
    out = torch.full((m, n), float("nan"))
    if a_scaled:
        a, a_s = per_token_group_quant_fp8(x, k)
        ref = (a.double() * a_s.double()) @ (b_q.double() * b_s.double()).T
    else:
        a, a_s = x, None
        ref = x.double() @ (b_q.double() * b_s.double()).T
    fp8_triton._launch(a, a_s, b_q, b_s, 1, k, torch.float32, plan, out, scale_after=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="scale_after takes one scale per row"):
        fp8_triton._launch(a, a_s, b_q, b_s, 1, 32, torch.float32, plan, out, scale_after=True)


def test_a_block_k_that_does_not_divide_the_group_is_refused():
    x, w = operands(2, 16, 64, 1)
    a_q, a_s = per_token_group_quant_fp8(x, 32)
    b_q, b_s = fp8_math.quantize_blocks(w, (16, 32))
    with pytest.raises(ValueError, match="BLOCK_K 64 must divide the scale group 32"):
        fp8_triton.fp8_gemm(a_q, a_s, b_q, b_s, 16, 32, torch.float32, tiles=(16, 16, 64))


@pytest.mark.parametrize("m,dtype", [(1, torch.float32), (3, torch.bfloat16), (17, torch.float32)])
def test_weight_only_block_gemm_matches_the_reference(m, dtype):
    x, w = operands(m, 40, 48, 10 + m)
    x = x.to(dtype)
    b_q, b_s = fp8_math.quantize_blocks(w, (16, 16))  # 40 rows: a partial last row block
    out = torch.full((m, 40), float("nan"), dtype=dtype)
    fp8_triton.fp8_weight_only_gemm(x, b_q, b_s, 16, 16, tiles=(16, 16, 16), out=out)
    ref = x.double() @ fp8_math.dequantize(b_q, b_s, (16, 16), torch.float64).T
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_weight_only_per_row_gemm_with_default_tiles():
    x, w = operands(2, 50, 300, 3)  # K 300: a partial K tile; N 50: a partial N tile
    b_q, b_s = fp8_math.quantize_per_row(w)
    out = torch.full((2, 50), float("nan"))
    fp8_triton.fp8_weight_only_gemm(x, b_q, b_s.reshape(-1, 1), 1, 300, out=out)
    ref = x.double() @ (b_q.double() * b_s.double()[:, None]).T
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="shapes do not fit"):
        fp8_triton.fp8_weight_only_gemm(x, b_q, b_s.reshape(-1, 1), 1, 100)
