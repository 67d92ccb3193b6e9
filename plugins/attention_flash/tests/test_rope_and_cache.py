"""triton_flash's rope fused into the cache write (`write_kv_rope`, `rope_and_cache_kernel`; interpreted on the
CPU, compiled on a GPU) against the two steps it replaces: the rope module's torch path (HF's rounding) and then
`write_kv`. The rotated q (read through the strided view a fused QKV projection gives) and every byte of a
poisoned cache must equal theirs -- bf16 / fp32, an fp8 cache with scales, partial rotary, more query heads
than one head block, padding rows (slot -1, and rows past num_actual_tokens) -- and q, k stay as they were.
Then the layer: `Attention(..., rotary=, positions=)` gives the output of rope-then-attention bit for bit."""

from __future__ import annotations

import types

import pytest
import torch
from keel_attention_flash.impl import TritonFlashAttentionImpl

from keel.attention.backend import AttentionLayerConfig
from keel.layers.fp8_utils import FP8
from keel.layers.rotary import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rope(head: int, rotary_dim: int) -> RotaryEmbedding:
    with torch.device(DEVICE):
        return RotaryEmbedding(head, rotary_dim, 64, {"rope_type": "default", "rope_theta": 10000.0})


def step(tokens: int, heads: int, kv_heads: int, head: int, dtype: torch.dtype, gen: torch.Generator):
    """A fused QKV output and its q / k / v views, positions, slots (some -1) of a poisoned cache."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head + 5, generator=gen).to(DEVICE, dtype)
    q = qkv[:, : heads * head].view(tokens, heads, head)
    k = qkv[:, heads * head : (heads + kv_heads) * head].view(tokens, kv_heads, head)
    v = qkv[:, (heads + kv_heads) * head : (heads + 2 * kv_heads) * head].view(tokens, kv_heads, head)
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(24, generator=gen)[:tokens]
    slots[1::4] = -1
    return qkv, q, k, v, positions, slots.to(DEVICE)


@pytest.mark.parametrize("dtype,heads,kv_heads,head,rotary_dim,fp8,tokens,actual", [
    (torch.bfloat16, 4, 2, 32, 32, False, 7, 7),
    (torch.float32, 6, 3, 40, 24, False, 5, 4),  # partial rotary; the last row past num_actual_tokens
    (torch.bfloat16, 80, 8, 128, 128, False, 3, 3),  # 80 query heads: more than one head block of 64
    (torch.bfloat16, 4, 1, 32, 16, True, 6, 5),  # fp8 cache, scales != 1, partial rotary
])
def test_rope_and_cache_is_the_rope_then_the_write(dtype, heads, kv_heads, head, rotary_dim, fp8, tokens, actual):
    gen = torch.Generator().manual_seed(heads * 10 + tokens)
    layer = AttentionLayerConfig(heads, kv_heads, head, head**-0.5, dtype, 4, kv_cache_dtype=FP8 if fp8 else None)
    impl = TritonFlashAttentionImpl(layer)
    if fp8:
        impl.set_kv_scales(torch.tensor([0.37], device=DEVICE), torch.tensor([2.5], device=DEVICE))
    qkv, q, k, v, positions, slots = step(tokens, heads, kv_heads, head, dtype, gen)
    rot = rope(head, rotary_dim)
    q_ref, k_ref = rot(positions, q.reshape(tokens, -1), k.reshape(tokens, -1))
    poison = torch.randint(0, 256, (2, 6, 4, kv_heads, head), generator=gen, dtype=torch.uint8).to(DEVICE)
    cache_dtype = FP8 if fp8 else dtype
    want = poison.view(cache_dtype) if fp8 else poison.to(dtype)
    got = want.clone()
    impl.write_kv(k_ref.view(tokens, kv_heads, head)[:actual], v[:actual], want, slots)
    before = qkv.clone()
    metadata = types.SimpleNamespace(common=types.SimpleNamespace(slot_mapping=slots), num_actual_tokens=actual)
    out = impl.write_kv_rope(q, k, v, positions, rot.cos_cache, rot.sin_cache, rotary_dim, got, metadata)
    assert out.shape == q.shape and out.is_contiguous()
    assert torch.equal(out.reshape(tokens, -1), q_ref)
    assert torch.equal(qkv, before)  # out of place
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_the_layer_with_its_rope_equals_rope_then_attention():
    from keel.attention.metadata import CommonAttentionMetadata
    from keel.layers.attention import Attention
    from keel_attention_flash.backend import TritonFlashAttentionBackend

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head, bs = 4, 2, 32, 4
    ctx_lens, q_lens = (5, 0, 9), (1, 6, 1)
    totals = [c + n for c, n in zip(ctx_lens, q_lens)]
    table = torch.arange(1, 1 + 3 * 4, dtype=torch.int32).view(3, 4)
    slots, pos = [], []
    for i, (c, t) in enumerate(zip(ctx_lens, totals)):
        for p in range(c, t):
            slots.append(int(table[i, p // bs]) * bs + p % bs)
            pos.append(p)
    n = len(slots)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(totals, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(DEVICE), query_start_loc_cpu=qsl, seq_lens=seq.to(DEVICE), seq_lens_cpu=seq,
        block_table=table.to(DEVICE), slot_mapping=torch.tensor(slots).to(DEVICE), num_reqs=3,
        num_actual_tokens=n, max_query_len=max(q_lens), max_seq_len=max(totals), block_size=bs)
    md = TritonFlashAttentionBackend.get_metadata_builder(torch.device(DEVICE)).build(common)
    layer_cfg = AttentionLayerConfig(heads, kv_heads, head, head**-0.5, torch.bfloat16, bs)
    impl = TritonFlashAttentionImpl(layer_cfg)
    attn = Attention.__new__(Attention)
    torch.nn.Module.__init__(attn)
    attn.layer_idx, attn.num_heads, attn.num_kv_heads, attn.head_size, attn.impl = 0, heads, kv_heads, head, impl
    rot = rope(head, head)
    positions = torch.tensor(pos).to(DEVICE)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head, generator=gen).to(DEVICE, torch.bfloat16)
    cache0 = torch.randn(2, 13, bs, kv_heads, head, generator=gen).to(DEVICE, torch.bfloat16)
    outs, caches = [], []
    for fused in (False, True):
        x = qkv.clone()
        q, k, v = x.split([heads * head, kv_heads * head, kv_heads * head], 1)
        cache = cache0.clone()
        ctx = types.SimpleNamespace(kv_caches=[cache], attn_metadata=[md])
        if fused:
            outs.append(attn(q, k, v, ctx, rotary=rot, positions=positions))
        else:
            qr, kr = rot(positions, q, k)
            outs.append(attn(qr, kr, v, ctx))
        caches.append(cache)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0], caches[1])
