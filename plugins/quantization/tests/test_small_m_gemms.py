"""The decode-size plans of the weight-only GEMMs (small_m_plan: "dot" / "gemv" kernel, tiles, K split),
interpreted on the CPU against a float64 reference on fresh inputs: fp8 with per-row and block scales
(partial edge blocks), int4 with in-order and gathered (desc_act) groups, odd M / N / K, K splits that do
and do not divide the tiles, bf16 activations, NaN-poisoned outputs (every element written)."""

from __future__ import annotations

import pytest
import torch
from keel_quantization import fp8_math, int4_math
from keel_quantization.int4_linear import tileable_group
from keel_quantization.quantizer_int4 import int4_tensors
from keel_quantization.small_m_plan import SmallMPlan, fp8_plan, int4_plan
from quant_test_utils import reference_linear

pytest.importorskip("triton")
fp8_triton = pytest.importorskip("keel_quantization.fp8_triton")
int4_triton = pytest.importorskip("keel_quantization.int4_triton")
from keel_quantization.splitk_reduce import SplitKOutput  # imports triton

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_quant.py runs it compiled")

# gemv num_stages: the loop's pipeline depth (tl.range), across a partial last tile, a split's end and, with 50
# splits asked of 19 tiles, splits of one tile
FP8_PLANS = [SmallMPlan("gemv", 1, 16, 16), SmallMPlan("gemv", 4, 8, 16, split_k=3),
             SmallMPlan("gemv", 2, 8, 16, split_k=50), SmallMPlan("dot", 16, 16, 16, split_k=4),
             SmallMPlan("gemv", 1, 16, 16, num_stages=1), SmallMPlan("gemv", 1, 16, 16, split_k=3, num_stages=2),
             SmallMPlan("gemv", 1, 8, 16, split_k=50, num_stages=2), SmallMPlan("gemv", 4, 8, 16, 3, num_stages=2),
             SmallMPlan("gemv", 1, 8, 16, num_stages=2), SmallMPlan("gemv", 1, 8, 16, split_k=3, num_stages=4),
             SmallMPlan("gemv", 4, 8, 16, num_stages=3)]


@pytest.mark.parametrize("plan", FP8_PLANS, ids=lambda p: f"{p.kernel}-{p.block_m}x{p.block_n}x{p.block_k}-s{p.split_k}"
                                                          f"-{p.num_stages}")
@pytest.mark.parametrize("m,n,k,block", [(1, 40, 300, None), (3, 40, 48, (16, 16)), (5, 24, 40, (16, 16))])
def test_fp8_weight_only_plans_match_the_reference(plan, m, n, k, block):
    gen = torch.Generator().manual_seed(m * 100 + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5
    if block is None:  # per-row scales: one group over all of K
        q, s = fp8_math.quantize_per_row(w)
        s, (gn, gk), deq = s.reshape(-1, 1), (1, k), q.double() * s.double()[:, None]
    else:
        q, s = fp8_math.quantize_blocks(w, block)
        (gn, gk), deq = block, fp8_math.dequantize(q, s, block, torch.float64)
    out = torch.full((m, n), float("nan"))
    fp8_triton.fp8_weight_only_gemm(x, q, s, gn, gk, out=out, plan=plan)
    torch.testing.assert_close(out.double(), x.double() @ deq.T, atol=1e-4, rtol=1e-4)


def test_fp8_gemv_in_bf16_and_m_past_its_block():
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(7, 64, generator=gen).bfloat16(), torch.randn(33, 64, generator=gen) / 8
    q, s = fp8_math.quantize_per_row(w)
    out = torch.full((7, 33), float("nan"), dtype=torch.bfloat16)  # M 7 over BLOCK_M 4: two M programs
    fp8_triton.fp8_weight_only_gemm(x, q, s.reshape(-1, 1), 1, 64, out=out, plan=SmallMPlan("gemv", 4, 16, 32, 2))
    ref = x.double() @ (q.double() * s.double()[:, None]).T
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_the_gemv_kernel_refuses_activation_scales():
    x, w = torch.randn(2, 32), torch.randn(16, 32)
    q, s = fp8_math.quantize_per_row(w)
    a_q, a_s = fp8_math.quantize_per_row(x)
    with pytest.raises(ValueError, match="weight-only"):
        fp8_triton._launch(a_q, a_s[:, None], q, s[:, None], 1, 32, torch.float32, SmallMPlan("gemv", 2, 16, 16), None)


INT4_PLANS = [SmallMPlan("gemv", 1, 16, 16), SmallMPlan("gemv", 8, 8, 32, split_k=2),
              SmallMPlan("gemv", 2, 16, 16, split_k=3), SmallMPlan("dot", 16, 16, 16, split_k=5)]


@pytest.mark.parametrize("plan", INT4_PLANS, ids=lambda p: f"{p.kernel}-{p.block_m}x{p.block_n}x{p.block_k}-s{p.split_k}")
@pytest.mark.parametrize("m,k,n,group,desc_act", [(1, 64, 64, 32, False), (5, 96, 40, 32, True),
                                                 (3, 128, 24, 64, False)])
def test_int4_plans_match_the_reference(plan, m, k, n, group, desc_act):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    tensors, deq = int4_tensors("gptq", "x.weight", torch.randn(n, k, generator=gen), group_size=group, sym=False,
                                desc_act=desc_act, seed=0)
    zeros = (int4_math.unpack_cols(tensors["x.qzeros"]) + 1).float()
    x = torch.randn(m, k, generator=gen)
    args = [x, tensors["x.qweight"], tensors["x.scales"].float(), zeros, tensors["x.g_idx"]]
    for group_size in {0, tileable_group(args[4], group)}:  # gathered, and one scale row per tile
        out = torch.full((m, n), float("nan"))
        int4_triton.int4_gemm(*args, out=out, group_size=group_size, plan=plan)
        torch.testing.assert_close(out.double(), reference_linear(x, deq), rtol=1e-4, atol=1e-4)


def test_split_k_covers_k_on_the_tile_grid():
    y = torch.empty(2, 3)
    s = SplitKOutput(y, 300, 16, 7)  # 19 tiles over 7 splits: 3 tiles (48 inputs) each, 7 with work
    assert (s.k_per_split, s.splits, tuple(s.buf.shape)) == (48, 7, (7, 2, 3))
    s = SplitKOutput(y, 64, 32, 8)  # 2 tiles: no more than 2 splits
    assert (s.k_per_split, s.splits) == (32, 2)
    s = SplitKOutput(y, 64, 32, 1)
    assert s.buf is y and s.strides == (0, 3, 1)


def test_default_plans_are_fixed_per_shape():
    assert fp8_plan(1, 4096, 4096, 4096) is fp8_plan(1, 4096, 4096, 4096)  # chosen once per shape (graph bucket)
    assert fp8_plan(1, 4096, 4096, 4096).kernel == "gemv" and fp8_plan(16, 4096, 4096, 4096).split_k == 4  # measured
    assert fp8_plan(65, 4096, 4096, 4096).split_k == 1 and int4_plan(4, 4096, 4096, 128).split_k == 8
    assert fp8_plan(1, 4096, 4096, 32).kernel == "dot"  # block 32: the measured K tile of 128 does not fit
    assert int4_plan(1, 4096, 4096, 128).kernel == int4_plan(2, 4096, 4096, 128).kernel == "gemv_fold"
    assert int4_plan(1, 4096, 4096, 0).kernel == "dot"  # gathered g_idx: gemv_fold unmeasured there
    for m in (1, 2, 4, 8, 16, 32, 64, 65):
        assert fp8_plan(m, 4096, 14336, 128).block_k <= 128  # block scales: a K tile lies in one group
        assert int4_plan(m, 4096, 4096, 128).fits_groups(128)  # a K tile in one group, or whole ones
    with pytest.raises(ValueError, match="kernel 'mma'"):
        SmallMPlan("mma", 16, 16, 16)
    with pytest.raises(ValueError, match="split_k must be >= 1"):
        SmallMPlan("dot", 16, 16, 16, split_k=0)


def test_layers_take_the_measured_plans():
    """Tables set (as the H200 sweep's best plans are): an fp8 layer's weight-only path and an int4 layer's
    Triton backend run the GEMV / split-K plans of their M bucket and match their reference paths."""
    from keel_quantization import small_m_plan
    from keel_quantization.fp8_linear import Fp8Scheme
    from keel_quantization.int4_linear import Int4LinearMethod
    from test_fp8_native_paths import fp8_layer, run
    from test_int4_linear import AWQ, load_all, quantized

    from keel.layers.linear import ReplicatedLinear

    gemv, split = SmallMPlan("gemv", 2, 16, 32, split_k=2), SmallMPlan("dot", 16, 16, 32, split_k=3)
    try:
        small_m_plan.use_tables({"fp8_row": ((2, gemv), (8, split)), "fp8_block": ((2, gemv), (8, split)),
                                 "int4": ((2, gemv), (8, split))})
        gen = torch.Generator().manual_seed(9)
        for scheme in (Fp8Scheme("dynamic_token"), Fp8Scheme("dynamic_group", (32, 32), "weight_scale_inv")):
            layer = fp8_layer(scheme, torch.float32)
            dense = layer.quant_method.dequantize_weight(layer).float()
            for m in (1, 2, 5):
                x = torch.randn(m, 96, generator=gen)
                want = torch.nn.functional.linear(x, dense, layer.bias.float())
                torch.testing.assert_close(run(layer, x, "weight_only"), want, atol=1e-5, rtol=1e-5)
        layer = ReplicatedLinear(64, 32, True, quant_config=Int4LinearMethod(AWQ, backend="triton"))
        tensors, deq = quantized(AWQ, torch.randn(32, 64, generator=gen))
        load_all(layer, tensors)
        layer.bias.data.copy_(torch.randn(32, generator=gen))  # not in the checkpoint: otherwise torch.empty's bytes
        layer.quant_method.process_weights_after_loading(layer)
        for m in (1, 2, 5):
            x = torch.randn(m, 64, generator=gen)
            torch.testing.assert_close(layer(x).double(), reference_linear(x, deq, layer.bias), rtol=1e-4, atol=1e-4)
    finally:
        small_m_plan.use_shipped()
