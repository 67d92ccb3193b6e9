"""kernels-triton's `mla_rope` (and `mla_rope_norm`) against the MLA layer's torch reference (`MLAAttention.rope`
unbound) on fresh random inputs: odd head counts and nope widths (q's rope part at an unaligned offset), rope dims whose half
is not a power of two, DeepSeek's 128 + 64, interleaved and not, q and k_pe as strided views of wider
projection outputs, poisoned output memory. The inputs are left untouched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from keel_kernels_triton.ops import TritonMLARope, TritonMLARopeNorm, TritonRMSNorm, UnsupportedTensorError

from keel.layers.layernorm import RMSNorm
from keel.layers.mla_attention import MLAAttention
from keel.layers.rotary import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (1e-3, 1e-3)}


def _reference(heads: int, nope: int, rot: int, interleaved: bool, rope_type: str = "default"):
    rope = {"rope_type": rope_type, "rope_theta": 10000.0}
    if rope_type == "yarn":  # DeepSeek's scaled rope (a cos/sin scale != 1)
        rope.update(factor=4.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=0.707)
    emb = RotaryEmbedding(rot, rot, 256, rope).to(DEVICE)
    layer = SimpleNamespace(bound_ops={}, rotary_emb=emb, num_heads=heads, qk_nope_head_dim=nope,
                            qk_rope_head_dim=rot, rope_interleaved=interleaved)
    return layer, emb


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,nope,rot,interleaved,rope_type", [
    (3, 5, 6, True, "default"),  # odd sizes: rope part at an unaligned offset, half 3
    (16, 128, 64, True, "yarn"),  # DeepSeek-V2-Lite's shape and scaled rope
    (40, 16, 8, False, "default"),  # more heads than one tile, neox order (V3 without rope_interleave)
    (1, 0, 4, True, "default"),  # no nope part at all
])
def test_mla_rope_matches_the_layer_reference(dtype, heads, nope, rot, interleaved, rope_type):
    gen = torch.Generator().manual_seed(heads * 7 + rot)
    layer, emb = _reference(heads, nope, rot, interleaved, rope_type)
    n = 9
    # q as the projection's output inside a wider buffer (strided rows); k_pe as kv_a's tail (strided).
    q_buf = torch.randn(n, heads * (nope + rot) + 3, generator=gen).to(DEVICE, dtype)
    q = q_buf[:, : heads * (nope + rot)].view(n, heads, nope + rot)
    kv_a = torch.randn(n, 11 + rot, generator=gen).to(DEVICE, dtype)
    k_pe = kv_a[:, 11:]
    positions = torch.tensor([0, 1, 2, 7, 31, 64, 100, 255, 3], device=DEVICE)
    q0, k0 = q.clone(), k_pe.clone()
    want_q, want_k = MLAAttention.rope(layer, positions, q, k_pe)
    # NaN-filled memory freed just before the op: an output element the kernel never writes stays NaN.
    torch.full(((q.numel() + k_pe.numel()) * 4,), float("nan"), dtype=dtype, device=DEVICE)
    got_q, got_k = TritonMLARope()(positions, q, k_pe, emb.cos_cache, emb.sin_cache, nope, interleaved)
    rtol, atol = TOL[dtype]
    for got, want in ((got_q, want_q), (got_k, want_k)):
        assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    assert torch.equal(q, q0) and torch.equal(k_pe, k0)


def test_mla_rope_refuses_shapes_it_cannot_read():
    _, emb = _reference(2, 4, 6, True)
    pos = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(UnsupportedTensorError, match="must be"):  # q's last dim is not nope + R
        TritonMLARope()(pos, torch.zeros(2, 2, 9, device=DEVICE), torch.zeros(2, 6, device=DEVICE),
                        emb.cos_cache, emb.sin_cache, 4, True)
    with pytest.raises(UnsupportedTensorError, match="contiguous last dim"):
        TritonMLARope()(pos, torch.zeros(2, 2, 20, device=DEVICE)[..., ::2], torch.zeros(2, 6, device=DEVICE),
                        emb.cos_cache, emb.sin_cache, 4, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,nope,rot,lora", [(3, 5, 6, 7), (16, 128, 64, 512)])
def test_mla_rope_norm_is_mla_rope_and_the_latents_rms_norm(dtype, heads, nope, rot, lora):
    """The fused op's q_pe / k_pe equal mla_rope's bit for bit, and its latent equals the rms_norm op's (same
    arithmetic, same reduction layout) and the layer's unbound reference within the dtype's rounding."""
    gen = torch.Generator().manual_seed(lora)
    layer, emb = _reference(heads, nope, rot, True)
    n = 5
    q = torch.randn(n, heads, nope + rot, generator=gen).to(DEVICE, dtype)
    kv_a = torch.randn(n, lora + rot + 2, generator=gen).to(DEVICE, dtype)  # kv_c and k_pe: strided views
    kv_c, k_pe = kv_a[:, :lora], kv_a[:, lora : lora + rot]
    norm = RMSNorm(lora, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(lora, generator=gen) + 0.5)
    positions = torch.tensor([0, 5, 9, 255, 1], device=DEVICE)
    kv0 = kv_c.clone()
    torch.full((n * lora * 4,), float("nan"), dtype=dtype, device=DEVICE)
    got_q, got_k, got_kv = TritonMLARopeNorm()(positions, q, k_pe, kv_c, norm.weight, 1e-6, emb.cos_cache,
                                              emb.sin_cache, nope, True)
    want_q, want_k = TritonMLARope()(positions, q, k_pe, emb.cos_cache, emb.sin_cache, nope, True)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_kv.is_contiguous() and got_kv.dtype == dtype and torch.isfinite(got_kv).all()
    # Bit for bit in float32 too: the fused op launches without multiply-add contraction (its rope) and
    # rms_norm_kernel with it, and both square through `_square`, which no launch option contracts (before it,
    # lora 7 differed in float32's last bits on an H200, Triton 3.6)
    assert torch.equal(got_kv, TritonRMSNorm()(kv_c, norm.weight, 1e-6))
    layer.bound_ops = {}
    layer.rope = lambda *a: MLAAttention.rope(layer, *a)
    ref_q, ref_k, ref_kv = MLAAttention.rope_norm(layer, positions, q, k_pe, kv_c, norm)
    rtol, atol = TOL[dtype]
    for got, want in ((got_q, ref_q), (got_k, ref_k), (got_kv, ref_kv)):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    assert torch.equal(kv_c, kv0)


def test_the_mla_layer_takes_the_fused_norm_only_for_a_plain_rms_norm_in_the_latents_dtype():
    """rope_norm calls mla_rope_norm for a plain RMSNorm of kv_c's dtype, else the norm then mla_rope."""
    layer, emb = _reference(2, 4, 6, True)
    calls = []
    layer.bound_ops = {"mla_rope_norm": lambda *a: calls.append("fused") or (None, None, None),
                       "mla_rope": lambda *a: calls.append("rope") or (None, None)}
    layer.rope = lambda *a: MLAAttention.rope(layer, *a)
    pos = torch.zeros(2, dtype=torch.long, device=DEVICE)
    q, k_pe, kv_c = (torch.zeros(2, 2, 10, device=DEVICE), torch.zeros(2, 6, device=DEVICE),
                     torch.ones(2, 8, device=DEVICE))
    MLAAttention.rope_norm(layer, pos, q, k_pe, kv_c, RMSNorm(8).to(DEVICE))
    MLAAttention.rope_norm(layer, pos, q, k_pe, kv_c, RMSNorm(8).to(DEVICE, torch.bfloat16))  # weight dtype differs
    MLAAttention.rope_norm(layer, pos, q, k_pe, kv_c, lambda x: x * 2)  # not an RMSNorm
    _, _, kv = MLAAttention.rope_norm(layer, pos, q, k_pe, kv_c, None)
    assert calls == ["fused", "rope", "rope", "rope"] and torch.equal(kv, kv_c)
