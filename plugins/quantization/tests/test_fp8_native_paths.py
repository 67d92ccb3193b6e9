"""The FP8 GPU paths through the layer's own dispatch, run on the CPU (Triton interpreted, torch's CPU
_scaled_mm): each path a layer can take -- weight-only for small M, _scaled_mm and the Triton W8A8 GEMM
above -- against the reference path on the same layer, at M on both sides of the weight-only bound; and
which path each scheme chooses for which M. tests/test_cuda_quant.py runs the same comparison compiled."""

from __future__ import annotations

import pytest
import torch
from keel_quantization import fp8_math, fp8_native
from keel_quantization.fp8_linear import Fp8LinearMethod, Fp8Scheme

from keel.layers.linear import ReplicatedLinear
from keel.models.loader import default_dtype

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_quant.py runs it compiled")

BLOCK = Fp8Scheme("dynamic_group", (32, 32), "weight_scale_inv")


def fp8_layer(scheme: Fp8Scheme, dtype: torch.dtype, n: int = 80, k: int = 96) -> ReplicatedLinear:
    with default_dtype(dtype):
        layer = ReplicatedLinear(k, n, True, quant_config=Fp8LinearMethod(scheme, "fp8"))
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) / k**0.5
    q, s = fp8_math.quantize_per_row(w) if scheme.block is None else fp8_math.quantize_blocks(w, scheme.block)
    layer.weight.data.copy_(q)
    getattr(layer, scheme.scale_name).data.copy_(s)
    layer.bias.data.copy_(torch.randn(n, generator=g))
    if scheme.activation == "static":
        layer.input_scale.data.fill_(0.01)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def run(layer: ReplicatedLinear, x: torch.Tensor, native: str | None, weight_only_max_m: int) -> torch.Tensor:
    method = layer.quant_method
    method.native, method.weight_only_max_m = native, weight_only_max_m
    return layer(x)


@pytest.mark.parametrize("scheme,dtype,native", [
    (Fp8Scheme("dynamic_token"), torch.bfloat16, "scaled_mm"),
    (Fp8Scheme("static"), torch.bfloat16, "scaled_mm"),
    (Fp8Scheme("dynamic_token"), torch.float32, "triton"),
    (BLOCK, torch.float32, "triton"),
])
def test_each_path_matches_the_reference_path(scheme, dtype, native):
    layer = fp8_layer(scheme, dtype)
    assert layer.quant_method.native is None  # CPU weights: the reference path
    gen = torch.Generator().manual_seed(5)
    bound = 4
    for m in (1, bound, bound + 3):  # weight-only, then W8A8
        x = torch.randn(m, 96, generator=gen).to(dtype)
        want_w8a8 = run(layer, x, None, 0)
        got = run(layer, x, native, bound)
        if m > bound:
            tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 output rounding of a different sum order
            torch.testing.assert_close(got.float(), want_w8a8.float(), atol=tol, rtol=tol)
        else:  # no activation quantization: the dequantized weight times x
            dense = layer.quant_method.dequantize_weight(layer).float()
            want = torch.nn.functional.linear(x.float(), dense, layer.bias.float())
            torch.testing.assert_close(got.float(), want, atol=2e-2 if dtype != torch.float32 else 1e-5, rtol=2e-2)


def test_weight_only_checkpoints_run_weight_only_at_every_m():
    layer = fp8_layer(Fp8Scheme("none"), torch.float32)
    x = torch.randn(70, 96)
    got = run(layer, x, "weight_only", fp8_native.choose_weight_only_max_m("weight_only", None))
    want = run(layer, x, None, 0)  # the reference: no activation quantization either
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_choice_per_m_is_made_once_from_the_large_m_path():
    assert fp8_native.choose_weight_only_max_m(None, None) == 0  # reference path: no kernels at all
    assert fp8_native.choose_weight_only_max_m("scaled_mm", None) == fp8_native.WEIGHT_ONLY_MAX_M
    assert fp8_native.choose_weight_only_max_m("triton", (128, 128)) == fp8_native.WEIGHT_ONLY_MAX_M
    assert fp8_native.choose_weight_only_max_m("weight_only", None) > 1 << 40
    assert fp8_native.choose_native(torch.empty(16, 16, dtype=fp8_math.FP8), "dynamic_token", None,
                                    torch.bfloat16) is None  # CPU weights
