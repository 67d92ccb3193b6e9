"""The int4 "dot" GEMM on bf16 / fp16 activations with in-order groups: each nibble is or-ed into the bits of
a float (OFFSET + q, no conversion per weight) and OFFSET * sum_k x is subtracted per tile. Interpreted on
the CPU against a float64 reference on fresh inputs: both dtypes, group sizes 32 / 128, M / N / K off the
tile grid, K splits, asymmetric zeros, activations with a large mean (the fold's cancellation at its worst),
NaN-poisoned outputs (every element written). Compiled where a GPU is (the H200 run's plugin tests);
bf16 only there: the Triton interpreter's tl.dot on bf16 operands returns garbage (~1e10 on a 16 x 16
product, any kernel), fp16 is right on both."""

from __future__ import annotations

import pytest
import torch
from keel_quantization import int4_math
from keel_quantization.quantizer_int4 import int4_tensors
from keel_quantization.small_m_plan import SmallMPlan
from quant_test_utils import reference_linear

pytest.importorskip("triton")
int4_triton = pytest.importorskip("keel_quantization.int4_triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# the output's rounding (bf16 8 bits, fp16 11) plus the float32 sums of the reference-free fold
RTOL = {torch.bfloat16: 8e-3, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m,k,n,group,plan,mean", [
    (5, 256, 40, 128, SmallMPlan("dot", 16, 16, 64), 0.0),
    (17, 192, 24, 32, SmallMPlan("dot", 16, 16, 32, split_k=3), 0.0),  # two M blocks, float32 partials
    (3, 128, 48, 128, SmallMPlan("dot", 16, 32, 128), 4.0),  # x = 4 + noise: sum x ~ 512 per tile
])
def test_half_precision_dot_matches_the_reference(dtype, m, k, n, group, plan, mean):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the Triton interpreter's tl.dot is wrong on bf16 operands (see the module docstring)")
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    tensors, _ = int4_tensors("gptq", "x.weight", torch.randn(n, k, generator=gen), group_size=group, sym=False,
                              desc_act=False, seed=m)
    scales = tensors["x.scales"].to(dtype)
    zeros = (int4_math.unpack_cols(tensors["x.qzeros"]) + 1).to(dtype)
    g_idx = tensors["x.g_idx"]
    x = (torch.randn(m, k, generator=gen) + mean).to(dtype)
    deq = int4_math.dequantize_int4(int4_math.unpack_rows(tensors["x.qweight"]), zeros.double(), scales.double(),
                                    g_idx, torch.float64).T  # [N, K] with the dtype's scales and zeros
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    int4_triton.int4_gemm(x.to(DEVICE), tensors["x.qweight"].to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE),
                          g_idx.to(DEVICE), out=out, group_size=group, plan=plan)
    ref = reference_linear(x, deq)
    out = out.cpu()
    torch.testing.assert_close(out.double(), ref, rtol=RTOL[dtype], atol=RTOL[dtype] * float(ref.abs().max()))
