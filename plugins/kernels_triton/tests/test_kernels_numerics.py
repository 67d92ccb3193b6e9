"""kernels-triton ops against keel's native layer math on fresh random inputs: non-power-of-two widths,
rows wider than one tile, strided (sliced) inputs, partial rotary dims, and poisoned output memory.
fp32 within 1e-5 relative; fp16/bf16 within the usual half-precision tolerance."""

from __future__ import annotations

import pytest
import torch
from keel_kernels_triton.ops import (
    TritonFusedAddRMSNorm,
    TritonRMSNorm,
    TritonRotaryEmbedding,
    TritonSiluAndMul,
    UnsupportedTensorError,
)

from keel.layers.activation import SiluAndMul
from keel.layers.layernorm import RMSNorm
from keel.layers.rotary import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (1e-3, 1e-3)}


def _poison(numel: int, dtype: torch.dtype) -> None:
    # NaN-filled memory freed just before the op: an output element the kernel never writes stays NaN.
    junk = torch.full((numel * 4,), float("nan"), dtype=dtype, device=DEVICE)
    del junk


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    rtol, atol = TOL[want.dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def _norm(hidden: int, dtype: torch.dtype, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(gen, hidden, dtype=torch.float32, scale=0.5) + 1)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 200, 8200])  # 8200 > MAX_NORM_BLOCK: the two-sweep path
def test_fused_add_rms_norm_matches_native(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    norm = _norm(hidden, dtype, gen)
    x, res = _randn(gen, 5, hidden, dtype=dtype, scale=3), _randn(gen, 5, hidden, dtype=dtype)
    x0, res0 = x.clone(), res.clone()
    want_out, want_res = norm(x, res)
    _poison(5 * hidden, dtype)
    out, new_res = TritonFusedAddRMSNorm()(x, res, norm.weight, norm.variance_epsilon)
    _close(new_res, want_res)
    _close(out, want_out)
    assert torch.equal(x, x0) and torch.equal(res, res0), "inputs must be left unchanged"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [24, 1000, 8200])
def test_rms_norm_matches_native(dtype, hidden):
    gen = torch.Generator().manual_seed(7 + hidden)
    norm = _norm(hidden, dtype, gen)
    x = _randn(gen, 3, hidden, dtype=dtype, scale=2)
    want = norm(x)
    _poison(3 * hidden, dtype)
    _close(TritonRMSNorm()(x, norm.weight, norm.variance_epsilon), want)


def test_rms_norm_per_head_on_a_strided_view_and_promoting_weight():
    # Qwen3's q/k norm: [n, heads, head_dim] views of a sliced qkv; a float32 weight on bf16 promotes.
    gen = torch.Generator().manual_seed(3)
    qkv = _randn(gen, 4, 3 * 48, dtype=torch.bfloat16)
    q = qkv[:, :96].view(4, 2, 48)
    norm = RMSNorm(48).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(_randn(gen, 48, dtype=torch.float32))
    want = norm(q)
    got = TritonRMSNorm()(q, norm.weight, norm.variance_epsilon)
    assert got.dtype == torch.float32 == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_zero_rows():
    w = torch.ones(40, device=DEVICE)
    x = torch.empty(0, 40, device=DEVICE)
    assert TritonRMSNorm()(x, w, 1e-6).shape == (0, 40)
    out, res = TritonFusedAddRMSNorm()(x, x, w, 1e-6)
    assert out.shape == res.shape == (0, 40)
    assert TritonSiluAndMul()(torch.empty(0, 6, device=DEVICE)).shape == (0, 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [5, 300, 1500])  # 1500 > one tile: several programs per row
def test_silu_and_mul_matches_native(dtype, d):
    gen = torch.Generator().manual_seed(d)
    x = _randn(gen, 3, 2 * d, dtype=dtype, scale=4)
    want = SiluAndMul()(x)
    _poison(3 * d, dtype)
    _close(TritonSiluAndMul()(x), want)


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(UnsupportedTensorError, match="odd"):
        TritonSiluAndMul()(torch.zeros(2, 7, device=DEVICE))


def _rope(head: int, rotary: int, rope_type: str = "default") -> RotaryEmbedding:
    params = {"rope_type": rope_type, "rope_theta": 10000.0}
    if rope_type == "llama3":
        params.update(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    with torch.device(DEVICE):
        return RotaryEmbedding(head, rotary, 256, params)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head,rotary,nq,nk,rope_type", [
    (64, 64, 6, 2, "default"),  # GQA, full rotary
    (80, 40, 3, 3, "llama3"),  # partial rotary (non-power-of-two halves and tail)
    (16, 16, 40, 1, "default"),  # more heads than one tile
])
def test_rotary_matches_native(dtype, head, rotary, nq, nk, rope_type):
    gen = torch.Generator().manual_seed(head + nq)
    rope = _rope(head, rotary, rope_type)
    n = 7
    # q and k as slices of one fused qkv row (strided, like QKVParallelLinear.split_qkv gives them).
    qkv = _randn(gen, n, (nq + 2 * nk) * head, dtype=dtype)
    q, k = qkv[:, : nq * head], qkv[:, nq * head : (nq + nk) * head]
    positions = torch.tensor([0, 1, 5, 17, 100, 255, 3], device=DEVICE)
    q0, k0 = q.clone(), k.clone()
    want_q, want_k = rope(positions, q, k)
    _poison(qkv.numel(), dtype)
    got_q, got_k = TritonRotaryEmbedding()(positions, q, k, rope.cos_cache, rope.sin_cache, head, rotary)
    _close(got_q, want_q)
    _close(got_k, want_k)
    if dtype != torch.float32:  # 16-bit: torch rounds each product and the sum; so does the kernel, bit for bit
        # (compiled without multiply-add contraction, which would leave one product unrounded)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_rotary_rejects_width_not_multiple_of_head():
    rope = _rope(16, 16)
    q = torch.zeros(2, 40, device=DEVICE)
    with pytest.raises(UnsupportedTensorError, match="multiple of 16"):
        TritonRotaryEmbedding()(torch.zeros(2, dtype=torch.long, device=DEVICE), q, q, rope.cos_cache,
                                rope.sin_cache, 16, 16)
