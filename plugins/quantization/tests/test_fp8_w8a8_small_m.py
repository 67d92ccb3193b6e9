"""The W8A8 small-M GEMM (fp8_w8a8_small_m_triton), interpreted on the CPU: the e4m3 activations it
multiplies are quantize_activations' (the large-M path's) exactly, so its output is float64
(dequantized activations) @ (dequantized weight)^T up to float32 summation: per-token, static and
per-token-group activations, per-row and block weight scales, partial N blocks and K tiles, K tiles
smaller than the group, K splits on and off (a split boundary inside a group), M = 1, 3, 16, 32 and
past a token tile, NaN-poisoned outputs (every element written). tests/test_cuda_quant_small_m.py runs
the compiled kernel."""

from __future__ import annotations

import pytest
import torch
from keel_quantization import fp8_math
from keel_quantization import small_m_plan
from keel_quantization.small_m_plan import SmallMPlan, w8a8_plan

from keel.layers.fp8_utils import dequant_per_token_group

pytest.importorskip("triton")
w8a8 = pytest.importorskip("keel_quantization.fp8_w8a8_small_m_triton")
from keel_quantization.fp8_native import quantize_activations  # noqa: E402 (after the triton check)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_quant_small_m.py runs it compiled")


def operands(n: int, k: int, block: tuple[int, int] | None, seed: int):
    """(w_q, w_s, group_n, group_k, float64 dequantized weight [N, K])."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5
    if block is None:  # per-row scales: one group over all of K
        q, s = fp8_math.quantize_per_row(w)
        return q, s.reshape(-1, 1), 1, k, q.double() * s.double()[:, None]
    q, s = fp8_math.quantize_blocks(w, block)
    return q, s, *block, fp8_math.dequantize(q, s, block, torch.float64)


def reference(x, activation, block, input_scale, deq):  # float64 [M, N] on quantize_activations' numbers
    a_q, a_s = quantize_activations(x, activation, block, input_scale)
    group = block[1] if activation == "dynamic_group" else x.shape[1]
    return dequant_per_token_group(a_q, a_s, group, torch.float64) @ deq.T


def activations(m: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, k)[torch.randperm(k, generator=gen)]
    x[0, : k // 3] = 0.0  # a token's first group(s) all zero: the smallest scale
    return x.to(dtype)


# split 2 of K tiles of 16: 80 inputs a split at K 160 (inside a group of 32), 48 at K 96
PLANS = [SmallMPlan("dot_w8a8", 16, 16, 32), SmallMPlan("dot_w8a8", 16, 32, 16, split_k=2),
         SmallMPlan("dot_w8a8", 32, 16, 32, split_k=3)]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.block_m}x{p.block_n}x{p.block_k}-s{p.split_k}")
@pytest.mark.parametrize("m,n,k,activation,block", [
    (1, 40, 96, "dynamic_token", None),  # N and K past the tiles' last full block
    (3, 40, 96, "static", None),
    (16, 24, 160, "dynamic_group", (16, 32)),  # 5 groups, K tiles of 16 inside them, a split inside a group
    (32, 40, 96, "dynamic_group", (32, 32)),  # a partial last N block (40 rows in blocks of 32)
    (3, 40, 112, "dynamic_token", (16, 32)),  # block weight scales with per-token activations; partial K group
    (20, 40, 96, "static", (16, 32)),  # M past a token tile of 16: two token programs
])
def test_matches_quantize_activations_then_matmul(plan, m, n, k, activation, block):
    if block is not None and block[1] % plan.block_k:
        pytest.skip("K tiles must lie in one scale group")
    q, s, gn, gk, deq = operands(n, k, block, m * n + k)
    x = activations(m, k, m + k)
    input_scale = torch.tensor([0.02]) if activation == "static" else None
    out = torch.full((m, n), float("nan"))
    w8a8.fp8_w8a8_small_m_gemm(x, q, s, gn, gk, activation, input_scale, out=out, plan=plan)
    torch.testing.assert_close(out.double(), reference(x, activation, block, input_scale, deq), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("plan", [SmallMPlan("gemv", 1, 8, 32), SmallMPlan("gemv", 4, 16, 32, split_k=2)],
                         ids=["1x8x32", "4x16x32-s2"])
@pytest.mark.parametrize("activation,block", [("dynamic_token", None), ("static", None),
                                              ("dynamic_group", (16, 32)), ("dynamic_token", (16, 32)),
                                              ("static", (16, 32))])
def test_the_gemv_plan_multiplies_the_same_activations(plan, activation, block):
    """A "gemv" plan: the weight-only GEMV's loop on the activations quantized in it -- the same numbers."""
    for m in (1, plan.block_m - 1) if plan.block_m > 1 else (1,):
        q, s, gn, gk, deq = operands(40, 96, block, m)
        x = activations(m, 96, m + 1)
        input_scale = torch.tensor([0.02]) if activation == "static" else None
        out = torch.full((m, 40), float("nan"))
        w8a8.fp8_w8a8_small_m_gemm(x, q, s, gn, gk, activation, input_scale, out=out, plan=plan)
        torch.testing.assert_close(out.double(), reference(x, activation, block, input_scale, deq), atol=1e-5,
                                   rtol=1e-5)
    if activation == "dynamic_group":  # its K tile must be the group: the tile's amax is the group's
        with pytest.raises(ValueError, match="does not fit scale groups"):
            w8a8.fp8_w8a8_small_m_gemm(x, q, s, gn, gk, activation, plan=SmallMPlan("gemv", 1, 8, 16))


@pytest.mark.parametrize("kernel", ["dot_w8a8", "gemv"])
@pytest.mark.parametrize("m", [1, 3])
def test_the_per_token_amax_in_several_chunks(monkeypatch, m, kernel):
    """The prologue's amax loads AMAX_ELEMENTS // rows inputs a row at a time: 32 here, a K of 96 in three
    chunks (the amax in the last), then 112 in four, the last partial."""
    monkeypatch.setattr(w8a8, "AMAX_ELEMENTS", 32 * triton_next_pow2(m))
    for k in (96, 112):
        q, s, gn, gk, deq = operands(40, k, None, k)
        x = activations(m, k, k)
        x[-1, k - 5] = 300.0  # the row's amax in the last chunk
        out = torch.full((m, 40), float("nan"))
        w8a8.fp8_w8a8_small_m_gemm(x, q, s, gn, gk, "dynamic_token", out=out,
                                   plan=SmallMPlan(kernel, 16 if kernel == "dot_w8a8" else triton_next_pow2(m), 16, 16))
        torch.testing.assert_close(out.double(), reference(x, "dynamic_token", None, None, deq), atol=1e-5, rtol=1e-5)


def triton_next_pow2(m: int) -> int:
    return 1 << (m - 1).bit_length()


def test_bf16_activations_and_the_default_plan():
    q, s, gn, gk, deq = operands(48, 256, (16, 128), 3)
    x = activations(5, 256, 4, torch.bfloat16)
    out = torch.full((5, 48), float("nan"), dtype=torch.bfloat16)
    w8a8.fp8_w8a8_small_m_gemm(x, q, s, gn, gk, "dynamic_group", out=out)  # w8a8_plan's: 16x64x128
    torch.testing.assert_close(out.double(), reference(x, "dynamic_group", (16, 128), None, deq), atol=2e-2,
                               rtol=1e-2)


def test_the_activation_scales_are_whole_rows_under_a_split():
    """One token whose largest input is in the last split only: every split scales by it."""
    q, s, gn, gk, deq = operands(32, 128, None, 7)
    x = torch.full((1, 128), 0.01)
    x[0, 120] = 300.0
    out = torch.full((1, 32), float("nan"))
    w8a8.fp8_w8a8_small_m_gemm(x, q, s, gn, gk, "dynamic_token", out=out,
                               plan=SmallMPlan("dot_w8a8", 16, 16, 16, split_k=8))
    torch.testing.assert_close(out.double(), reference(x, "dynamic_token", None, None, deq), atol=1e-5, rtol=1e-5)


def test_plans_and_refusals():
    assert w8a8_plan(1, 4096, 4096, 4096) is w8a8_plan(1, 4096, 4096, 4096)  # chosen once per shape
    assert w8a8_plan(1, 4096, 4096, 4096).block_k == 256  # the measured table's M = 1 row (per row)
    assert w8a8_plan(16, 4096, 4096, 128).num_warps == 8  # and its M 5-16 row (per block)
    try:  # the built-in default, the tables aside
        small_m_plan.use_tables({})
        assert small_m_plan.w8a8_max_m(True) == 0
        p = w8a8_plan(1, 4096, 4096, 4096)
        assert (p.kernel, p.block_m, p.block_n, p.block_k, p.split_k) == ("dot_w8a8", 16, 64, 128, 4)  # 256 programs
        assert w8a8_plan(32, 4096, 4096, 4096).block_m == 32 and w8a8_plan(1, 28672, 4096, 4096).split_k == 1
        assert w8a8_plan(1, 4096, 14336, 128).block_k == 128 and w8a8_plan(1, 4096, 256, 128).split_k == 1
    finally:
        small_m_plan.use_shipped()
    assert w8a8.misfit(4096) is None and "not a multiple of 16" in w8a8.misfit(4100)
    q, s, gn, gk, _ = operands(32, 64, (16, 32), 0)
    with pytest.raises(ValueError, match="does not fit scale groups"):
        w8a8.fp8_w8a8_small_m_gemm(torch.randn(2, 64), q, s, gn, gk, "dynamic_group",
                                   plan=SmallMPlan("dot_w8a8", 16, 16, 64))
    with pytest.raises(ValueError, match="does not fit scale groups"):  # a weight-only plan
        w8a8.fp8_w8a8_small_m_gemm(torch.randn(2, 64), q, s, gn, gk, "dynamic_group",
                                   plan=SmallMPlan("dot", 16, 16, 32))


@pytest.mark.parametrize("activation,block", [("dynamic_token", None), ("static", None),
                                              ("dynamic_group", (32, 32)), ("dynamic_group", (16, 64))])
def test_the_activations_are_quantize_activations_bit_for_bit(activation, block):
    """With the identity as the weight each output is one activation's e4m3 value times its scale (exact
    products, nothing else summed): equal to quantize_activations' dequantized values, bit for bit,
    including subnormals, saturation (static) and inputs rounding up into the next binade."""
    k = 96
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1)) * torch.logspace(-4, 4, k)
    x[1, :8] = torch.tensor([124.4, 123.9, 0.0029, -0.0029, 1e-9, -0.0, 15.5, -15.5])
    eye = torch.eye(k).to(fp8_math.FP8)
    gn, gk = block or (1, k)
    s = torch.ones(-(-k // gn), -(-k // gk))
    input_scale = torch.tensor([0.05]) if activation == "static" else None  # large inputs saturate
    out = torch.full((3, k), float("nan"))
    w8a8.fp8_w8a8_small_m_gemm(x, eye, s, gn, gk, activation, input_scale, out=out,
                               plan=SmallMPlan("dot_w8a8", 16, 32, 16, split_k=2))
    a_q, a_s = quantize_activations(x, activation, block, input_scale)
    want = dequant_per_token_group(a_q, a_s, gk if activation == "dynamic_group" else k, torch.float64).float()
    assert torch.equal(out, want), int((out != want).sum())
