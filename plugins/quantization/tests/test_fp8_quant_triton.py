"""The fused FP8 activation quantization kernel (interpreted on the CPU; compiled on a GPU by
tests/test_cuda_quant.py) against the torch functions the reference path rounds with: bit-equal fp8
values and scales, per token and group (a partial last group; more groups than one program takes), per
token (K not a power of two), static (saturating), on inputs spanning e4m3's subnormals, zero rows and
negative zeros, the shared e4m3 edge list (keel.testing.e4m3_edges), into NaN-poisoned outputs."""

from __future__ import annotations

import pytest
import torch
from keel_quantization import fp8_math

from keel.layers.fp8_utils import FP8, MIN_SCALE, per_token_group_quant_fp8
from keel.testing.e4m3_edges import e4m3_edge_values

pytest.importorskip("triton")
fp8_quant_triton = pytest.importorskip("keel_quantization.fp8_quant_triton")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_quant.py runs it compiled")


def activations(m: int, k: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # magnitudes over 8 decades: a token's small inputs land on e4m3's subnormals or round to zero
    x = torch.randn(m, k, generator=gen) * torch.logspace(-4, 4, k)[torch.randperm(k, generator=gen)]
    x = x.to(dtype)
    x[0] = 0.0  # an all-zero token: the minimum scale, zeros out
    if m > 1:
        x[1, :3] = -0.0
    return x


def poisoned(m: int, k: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.full((m, k), 0x7F, dtype=torch.uint8).view(FP8)  # e4m3fn NaN
    return q, torch.full((m, groups), float("nan"))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), int((a.view(torch.uint8) != b.view(torch.uint8)).sum())


@pytest.mark.parametrize("m,k,group", [(3, 40, 16), (5, 300, 128), (2, 4100, 128), (4, 77, 32)])
def test_per_token_group_is_bit_equal_to_the_torch_reference(m, k, group):
    x = activations(m, k, m * k)
    groups = -(-k // group)
    q, s = fp8_quant_triton.quant_fp8(x, group, out=poisoned(m, k, groups))
    want_q, want_s = per_token_group_quant_fp8(x, group)
    same_bits(q, want_q)
    assert torch.equal(s, want_s)
    assert torch.equal(s[0], torch.full_like(s[0], MIN_SCALE))


@pytest.mark.parametrize("m,k,dtype", [(1, 48, torch.bfloat16), (6, 1000, torch.float16), (3, 5000, torch.float32)])
def test_per_token_is_one_group_per_row(m, k, dtype):
    x = activations(m, k, k, dtype)
    q, s = fp8_quant_triton.quant_fp8(x, k, out=poisoned(m, k, 1))
    want_q, want_s = fp8_math.quantize_per_row(x)
    same_bits(q, want_q)
    assert torch.equal(s, want_s[:, None])


def test_static_scale_saturates_and_is_written_per_token():
    x = activations(5, 96, 3)
    x[2, 7] = 1e4  # far above 448 * scale: saturates to the largest e4m3
    scale = torch.tensor([0.05])
    q, s = fp8_quant_triton.quant_fp8(x, 96, scale, out=poisoned(5, 96, 1))
    same_bits(q, fp8_math.to_fp8(x, scale))
    assert float(q[2, 7].float()) == 448.0
    assert torch.equal(s, scale.expand(5, 1))


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_static_scale_rounds_the_shared_e4m3_edges_as_torch(scale):
    """keel.testing.e4m3_edges (every e4m3 value, ties and their float32 neighbours, binade edges, subnormals,
    saturation, signed zeros) at power-of-two scales, so x / scale meets each edge exactly. NaN is left out:
    the activation kernel saturates with tl.minimum / tl.maximum, which need not keep it."""
    x = e4m3_edge_values(nan=False)[None, :] * scale  # [1, n]
    n = x.shape[1]
    s = torch.tensor([scale])
    q, _ = fp8_quant_triton.quant_fp8(x, n, s, out=poisoned(1, n, 1))
    same_bits(q, fp8_math.to_fp8(x, s))


def test_no_tokens_and_misfit_outputs():
    q, s = fp8_quant_triton.quant_fp8(torch.empty(0, 64), 32)
    assert q.shape == (0, 64) and s.shape == (0, 2)
    with pytest.raises(ValueError, match="does not fit"):
        fp8_quant_triton.quant_fp8(torch.randn(2, 64), 32, out=poisoned(2, 64, 1))
    with pytest.raises(ValueError, match="static scale is one per tensor"):
        fp8_quant_triton.quant_fp8(torch.randn(2, 64), 32, torch.tensor([1.0]))


@pytest.mark.parametrize("m", [5, 8, 1])
def test_padding_rows_and_token_major_scales_for_cublas(m):
    """cuBLAS's block-scaled GEMM operands (fp8_cublas_block.quantize_activations): rows rounded up to 4,
    the padding rows zero with the minimum scale, the scales token-major (strides (1, rows)), written by the
    same launch into poisoned buffers; the real rows bit-equal to the torch reference."""
    from keel_quantization import fp8_cublas_block

    x = activations(m, 384, 7)
    rows = -(-m // 4) * 4
    q, s = poisoned(rows, 384, 3)
    s = s.t().contiguous().t()  # token-major, as cuBLAS reads them
    got_q, got_s = fp8_quant_triton.quant_fp8(x, 128, out=(q, s))
    assert got_s.stride() == (1, rows)
    want_q, want_s = per_token_group_quant_fp8(x, 128)
    same_bits(got_q[:m], want_q)
    assert torch.equal(got_s[:m], want_s)
    same_bits(got_q[m:], torch.zeros(rows - m, 384).to(FP8))
    assert torch.equal(got_s[m:], torch.full((rows - m, 3), MIN_SCALE))
    a_q, a_s = fp8_cublas_block.quantize_activations(x)
    assert a_q.shape == (rows, 384) and a_s.shape == (rows, 3) and a_s.stride() == (1, rows)
    same_bits(a_q, got_q)
    assert torch.equal(a_s, got_s)


LOOP = fp8_quant_triton.QuantLaunch("loop", 4, 256)


@pytest.mark.parametrize("m,k,dtype", [(3, 1000, torch.bfloat16), (2, 512, torch.float16), (1, 300, torch.float32)])
def test_row_loop_launch_is_bit_equal_to_the_tile_launch(m, k, dtype):
    """The chunked one-token-per-program launch (large tokens, many rows): a partial last chunk, a K that is
    a whole number of chunks, rows past x's zero with the minimum scale, into poisoned outputs."""
    x = activations(m, k, 11 * k, dtype)
    rows = m + 2
    q, s = fp8_quant_triton.quant_fp8(x, k, out=poisoned(rows, k, 1), launch=LOOP)
    want_q, want_s = fp8_math.quantize_per_row(x)
    same_bits(q[:m], want_q)
    assert torch.equal(s[:m], want_s[:, None])
    same_bits(q[m:], torch.zeros(2, k).to(FP8))
    assert torch.equal(s[m:], torch.full((2, 1), MIN_SCALE))
    scale = torch.tensor([0.05])
    q, s = fp8_quant_triton.quant_fp8(x, k, scale, out=poisoned(m, k, 1), launch=LOOP)
    same_bits(q, fp8_math.to_fp8(x, scale))
    assert torch.equal(s, scale.expand(m, 1))


def test_launch_choice():
    choose = fp8_quant_triton.choose_launch
    assert choose(8192, 14336, 14336) == choose(64, 14336, 14336) == fp8_quant_triton.QuantLaunch("loop", 8, 2048)
    assert choose(8192, 4096, 4096) == choose(8192, 14336, 128) == fp8_quant_triton.QuantLaunch()  # block groups
    assert choose(256, 4096, 4096) == choose(64, 14336, 128) == fp8_quant_triton.QuantLaunch("tile", 16)
    with pytest.raises(ValueError, match="one scale per token"):
        fp8_quant_triton.quant_fp8(torch.randn(2, 512), 128, launch=LOOP)
