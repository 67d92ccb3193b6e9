"""The fp8 KV cache's in-kernel e4m3 quantization (`keel_attention_flash.e4m3`) against torch, element by element
(interpreted on the CPU, compiled on a GPU): `quantize_e4m3_bits` gives quantize_kv's bytes for the shared edge
list (`keel.testing.e4m3_edges`: ties, binade edges, subnormals, saturation, signed zeros, NaN) and random
inputs over many decades, at scales that are and are not powers of two; `round_to_e4m3` stays bit-equal to
its twin in the quantization plugin."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from keel_attention_flash.e4m3 import quantize_e4m3_bits, round_to_e4m3

from keel.layers.fp8_utils import FP8
from keel.layers.kv_scales import quantize_kv
from keel.testing.e4m3_edges import assert_same_e4m3_bytes, e4m3_edge_values

try:  # a test may import both plugins; the attention plugin itself never imports the quantization plugin
    from keel_quantization.fp8_quant_triton import _round_to_e4m3
except ImportError:
    _round_to_e4m3 = None

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 512


@triton.jit
def _bits_kernel(x_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(out_ptr + i, quantize_e4m3_bits(x, tl.load(scale_ptr)), mask=i < n)


def kernel_bytes(x: torch.Tensor, scale: float) -> torch.Tensor:  # x float32 [n] -> uint8 [n]
    out = torch.full(x.shape, 0x55, dtype=torch.uint8, device=DEVICE)
    _bits_kernel[(triton.cdiv(x.numel(), BLOCK),)](x.to(DEVICE), torch.tensor([scale], device=DEVICE), out,
                                                    x.numel(), BLOCK=BLOCK)
    return out.cpu()


def random_inputs(n: int, seed: int) -> torch.Tensor:  # float32 [n], magnitudes over 12 decades
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * torch.logspace(-8, 4, n)[torch.randperm(n, generator=gen)]


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.37, 3.0, 2.0**-7])
def test_quantize_bits_equal_quantize_kv(scale):
    edges = e4m3_edge_values()
    # The edges as x / scale sees them: exact for powers of two, a rounding away for the others.
    x = torch.cat((edges, edges * scale, random_inputs(3000, int(scale * 100))))
    want = quantize_kv(x, torch.tensor([scale]), FP8).view(torch.uint8)
    assert_same_e4m3_bytes(kernel_bytes(x, scale), want)


def test_nan_stays_nan_and_overflow_saturates():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -500.0, 448.0, 464.0])
    got = kernel_bytes(x, 1.0).view(FP8).float()
    assert got[0].isnan()
    assert got[1:].tolist() == [448.0, -448.0, 448.0, -448.0, 448.0, 448.0]


@triton.jit
def _twin_kernel(x_ptr, ours_ptr, theirs_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(ours_ptr + i, round_to_e4m3(x), mask=i < n)
    tl.store(theirs_ptr + i, _round_to_e4m3(x), mask=i < n)


def test_round_to_e4m3_is_the_quantization_plugins_twin():
    if _round_to_e4m3 is None:
        pytest.skip("keel-quantization is not installed")
    x = torch.cat((e4m3_edge_values(), random_inputs(3000, 7))).clamp(-448.0, 448.0)  # its domain (NaN kept)
    ours, theirs = (torch.full_like(x, float("nan"), device=DEVICE) for _ in range(2))
    _twin_kernel[(triton.cdiv(x.numel(), BLOCK),)](x.to(DEVICE), ours, theirs, x.numel(), BLOCK=BLOCK)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    finite = ~x.isnan()
    # and both are torch's rounding, signed zeros included
    assert torch.equal(ours.cpu()[finite].view(torch.int32), x[finite].to(FP8).float().view(torch.int32))
