"""triton_mla (interpreted on the CPU, compiled on CUDA) against a float64 fully expanded reference.

The reference expands every context token's K/V from its latent, never touching the paged cache.
triton_mla must agree on mixed batches (decodes through split-K, prefills and chunked prefills through
query tiles), over random scattered block tables with NaN everywhere outside the requests' contexts
(unused slots, the null block), with -1-padded slot mappings and padded rows; it must leave exactly
cat(kv_c, k_pe) of each new token in its slot and never expand the cache on decode.
"""

from __future__ import annotations

import pytest
import torch
from keel_attention_flash.mla_backend import TritonMLABackend
from keel_attention_flash.mla_impl import TritonMLAImpl

from keel.attention.backend import AttentionLayerConfig
from keel.attention.metadata import CommonAttentionMetadata
from keel.layers.fp8_utils import FP8
from keel.layers.kv_scales import quantize_kv
from keel.testing.e4m3_edges import assert_same_e4m3_bytes

H, N, R, V, L = 4, 16, 8, 16, 32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def mla_layer(block_size: int, dtype: torch.dtype = torch.float32, **kw) -> AttentionLayerConfig:
    fields = {
        "num_heads": H, "num_kv_heads": 1, "head_size": L + R, "scale": (N + R) ** -0.5, "dtype": dtype,
        "block_size": block_size, "use_mla": True,
        "extra": (("kv_lora_rank", L), ("qk_nope_head_dim", N), ("qk_rope_head_dim", R), ("v_head_dim", V)),
    }
    return AttentionLayerConfig(**{**fields, **kw})


def make_step(context_lens, query_lens, bs: int, gen: torch.Generator, pad_rows: int = 0):
    """Random float64 latents of each request's full context, a scattered block table, the step's
    common metadata (`pad_rows` extra rows with slot -1) and a NaN-poisoned float32 cache holding the
    earlier context."""
    totals = [c + q for c, q in zip(context_lens, query_lens)]
    blocks = [-(-t // bs) for t in totals]
    spare = 3  # blocks nobody owns: NaN
    perm = (torch.randperm(sum(blocks) + spare, generator=gen) + 1).tolist()  # never the null block
    table = torch.zeros(len(totals), max(blocks) + 1, dtype=torch.int32)  # a trailing null entry
    for i, nb in enumerate(blocks):
        table[i, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
    latents = [torch.randn(t, L + R, generator=gen, dtype=torch.float64) for t in totals]
    rows, slots = [], []
    for i, (c, t) in enumerate(zip(context_lens, totals)):
        for p in range(c, t):
            slots.append(int(table[i, p // bs]) * bs + p % bs)
            rows.append(latents[i][p])
    num_tokens = len(slots)
    rows += [torch.randn(L + R, generator=gen, dtype=torch.float64) for _ in range(pad_rows)]
    slots += [-1] * pad_rows
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(totals, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(DEVICE), query_start_loc_cpu=qsl, seq_lens=seq_lens.to(DEVICE),
        seq_lens_cpu=seq_lens, block_table=table.to(DEVICE), slot_mapping=torch.tensor(slots).to(DEVICE),
        num_reqs=len(totals), num_actual_tokens=num_tokens, max_query_len=max(query_lens),
        max_seq_len=max(totals), block_size=bs,
    )
    cache = torch.full((sum(blocks) + spare + 1, bs, L + R), float("nan"))
    for i, c in enumerate(context_lens):
        for p in range(c):  # earlier steps wrote the context
            cache[table[i, p // bs], p % bs] = latents[i][p].float()
    return latents, torch.stack(rows), common, cache.to(DEVICE)


def reference(q, latents, context_lens, query_lens, w_uk, w_uv, scale):  # float64, fully expanded
    out, start = [], 0
    for lat, c, n in zip(latents, context_lens, query_lens):
        k = torch.cat((torch.einsum("sl,hnl->hsn", lat[:, :L], w_uk), lat[None, :, L:].expand(H, -1, -1)), -1)
        v = torch.einsum("sl,hvl->hsv", lat[:, :L], w_uv)
        qi = q[start : start + n].transpose(0, 1)  # [H, n, N + R]
        scores = qi @ k.transpose(1, 2) * scale  # [H, n, S]
        mask = torch.arange(c + n)[None, :] <= torch.arange(c, c + n)[:, None]
        o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v  # [H, n, V]
        out.append(o.transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.fixture(autouse=True)
def nan_empty(monkeypatch):
    """Every float tensor the impl leaves uninitialized starts as NaN: a row it forgets to write shows."""
    real = torch.empty

    def poisoned(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


def run_case(context_lens, query_lens, bs, *, seed=0, splits=None, pad_rows=0, dtype=torch.float32,
             atol=2e-5, k_scale=None, fp8_words=None, blocks_ahead=None):
    """`k_scale`: an e4m3 latent cache (the context quantized by torch's quantize_kv, NaN elsewhere), the
    reference reading it as torch_mla does, (stored * k_scale) rounded to `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    latents, new_latents, common, cache = make_step(context_lens, query_lens, bs, gen, pad_rows)
    w_uk = torch.randn(H, N, L, generator=gen, dtype=torch.float64) / L**0.5
    w_uv = torch.randn(H, V, L, generator=gen, dtype=torch.float64) / L**0.5
    q = torch.randn(new_latents.shape[0], H, N + R, generator=gen, dtype=torch.float64)
    layer = mla_layer(bs, dtype, kv_cache_dtype=FP8 if k_scale else None)
    impl = TritonMLAImpl(layer, decode_splits=splits, decode_fp8_words=fp8_words, decode_blocks_ahead=blocks_ahead)
    impl.process_weights_after_loading(w_uk.to(DEVICE, dtype), w_uv.to(DEVICE, dtype))
    md = TritonMLABackend.get_metadata_builder(torch.device(DEVICE)).build(common)
    dev = new_latents.to(DEVICE, dtype)
    if k_scale:
        scale = torch.tensor([k_scale], device=DEVICE)
        impl.set_kv_scales(scale, scale)
        cache = quantize_kv(cache, scale, FP8)  # NaN stays NaN
        latents = [(quantize_kv(lat.to(DEVICE, dtype), scale, FP8).float() * scale).to(dtype).double().cpu()
                   for lat in latents]
    else:
        cache = cache.to(dtype)
    qd = q.to(DEVICE, dtype)
    out = impl.forward(qd[..., :N], qd[..., N:], dev[:, :L], dev[:, L:], cache, md)
    num = common.num_actual_tokens
    ref = reference(q[:num], latents, context_lens, query_lens, w_uk, w_uv, layer.scale)
    assert out.shape == (q.shape[0], H, V)
    assert out.is_contiguous()  # the layer's reshape to [T, H * V] is a view, not a copy kernel
    assert torch.isfinite(out).all()  # padding rows included
    torch.testing.assert_close(out[:num].double().cpu(), ref, atol=atol, rtol=0)
    written = cache.view(-1, L + R)[common.slot_mapping[:num]]
    if k_scale:
        assert_same_e4m3_bytes(written, quantize_kv(dev[:num], scale, FP8))
    else:
        torch.testing.assert_close(written.double().cpu(), new_latents[:num].to(dtype).double(), atol=0, rtol=0)
    return cache, common


@pytest.mark.parametrize(
    "context_lens,query_lens,bs,splits",
    [
        ((0, 5, 31, 16, 70), (1, 1, 1, 1, 1), 4, None),  # pure decode, one split each
        ((0, 5, 31, 16, 70), (1, 1, 1, 1, 1), 8, 4),  # split-K with empty splits (short contexts)
        ((130, 77), (1, 1), 16, 3),  # split-K, non-power-of-two split count, partial last tile (W_UV reduces)
        ((0, 5, 31, 70), (1, 1, 1, 1), 8, 4),  # W_UV reducing the splits, empty ones and an empty context
        ((0, 17, 0, 40, 9), (21, 1, 6, 1, 5), 4, 2),  # mixed: prefill, decode, chunk, decode, chunk
        ((12, 3), (9, 4), 8, None),  # chunked prefill over a cached prefix
        ((0,), (67,), 16, None),  # one long prefill: several query and key tiles
    ],
)
def test_forward_matches_expanded_reference(context_lens, query_lens, bs, splits):
    run_case(context_lens, query_lens, bs, seed=sum(context_lens) + bs, splits=splits)


def test_slot_minus_one_padding_rows_are_skipped_and_finite():
    cache, common = run_case((6, 0, 9), (1, 5, 1), 4, seed=3, pad_rows=3)
    # only the real tokens' slots were written; every other slot outside the contexts stays NaN
    written = torch.zeros(cache.shape[0] * cache.shape[1], dtype=torch.bool)
    for i, t in enumerate(common.seq_lens_cpu.tolist()):
        for p in range(t):
            written[int(common.block_table[i, p // 4]) * 4 + p % 4] = True
    flat = cache.view(-1, L + R).cpu()
    assert torch.isnan(flat[~written]).all() and torch.isfinite(flat[written]).all()


def test_bfloat16_within_rounding():
    run_case((0, 23, 9), (11, 1, 4), 8, seed=5, splits=2, dtype=torch.bfloat16, atol=5e-2)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("context_lens,query_lens,bs,splits", [
    ((0, 5, 31, 16, 70), (1, 1, 1, 1, 1), 8, 4),  # split-K decode: k_scale applied to each split's partial
    ((0, 17, 9), (21, 1, 5), 4, None),  # prefill tiles next to a decode
])
def test_fp8_latent_cache_with_the_scale_folded_out_of_the_tiles(context_lens, query_lens, bs, splits, dtype, atol):
    """Raw e4m3 latent tiles (exact in q's dtype), k_scale folded into the score scale and the output, against
    a reference whose keys and values are each stored latent * k_scale rounded to q's dtype. Tolerances: the
    unquantized path's. float32: the two differ by float32 rounding alone; bfloat16: the fold only skips the
    reference's rounding of each dequantized element (<= 2^-9 relative, unbiased, averaged over the 40-wide
    scores and the weighted sum of values), inside the bf16 rounding of q, p and the output that 5e-2 covers.
    The scale spreads the stored values over e4m3's range; the new tokens' bytes are quantize_kv's."""
    run_case(context_lens, query_lens, bs, seed=sum(context_lens), splits=splits, dtype=dtype, atol=atol,
             k_scale=0.02, pad_rows=2)


@pytest.mark.parametrize("splits", [1, 4])
def test_fp8_latent_cache_read_as_words(splits):
    """Decode reading the e4m3 latent cache as int32 words (latent and rope parts, converted four values at a
    time; interpreted: byte by byte) with fp16 operands, against the same reference and tolerance as the byte
    path, next to a prefill tile (which reads bytes)."""
    run_case((0, 5, 31, 16, 70), (1, 1, 1, 1, 1), 8, seed=122, splits=splits, dtype=torch.bfloat16,
             atol=5e-2, k_scale=0.02, pad_rows=2, fp8_words=True)
    run_case((0, 17, 9), (21, 1, 5), 4, seed=26, splits=splits, dtype=torch.bfloat16, atol=5e-2, k_scale=0.02,
             fp8_words=True)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_block_numbers_loaded_a_tile_ahead(splits):
    """BLOCKS_AHEAD: the decode loop carries the next key tile's block numbers from the iteration before (three
    stages); contexts of several 64-token tiles in each split, a partial last tile and empty splits, in float32,
    bf16 and over an fp8 latent cache read as bytes and as words, against the reference the shipped loop meets."""
    ctx, ql = (0, 5, 31, 70, 300), (1, 1, 1, 1, 1)  # 64-token tiles: 300 is two or more a split
    run_case(ctx, ql, 4, seed=40 + splits, splits=splits, blocks_ahead=True)
    run_case(ctx, ql, 8, seed=50 + splits, splits=splits, dtype=torch.bfloat16, atol=5e-2, blocks_ahead=True)
    for words in (False, True):
        run_case(ctx, ql, 8, seed=60 + splits, splits=splits, dtype=torch.bfloat16, atol=5e-2, k_scale=0.02,
                 pad_rows=2, fp8_words=words, blocks_ahead=True)


def test_fp8_latent_words_refused_where_they_cannot_apply():
    with pytest.raises(ValueError, match="decode_fp8_words"):
        TritonMLAImpl(mla_layer(4, torch.float32, kv_cache_dtype=FP8), decode_fp8_words=True)
    with pytest.raises(ValueError, match="decode_fp8_words"):
        TritonMLAImpl(mla_layer(4, torch.bfloat16), decode_fp8_words=True)  # no fp8 cache


def test_decode_is_absorbed_and_never_expands(monkeypatch):
    """Decode goes only through the split-K launch; no tensor of the context's size x heads x head dim
    is ever created (the expanded K would be [ctx, H, N])."""
    from torch.utils._python_dispatch import TorchDispatchMode

    gen = torch.Generator().manual_seed(11)
    ctx = (150, 170, 190)
    _, new_latents, common, cache = make_step(ctx, (1, 1, 1), 8, gen)
    impl = TritonMLAImpl(mla_layer(8), decode_splits=4)
    impl.process_weights_after_loading(torch.randn(H, N, L, generator=gen).to(DEVICE),
                                       torch.randn(H, V, L, generator=gen).to(DEVICE))
    calls: list[str] = []
    for name in ("_decode", "_prefill"):
        real = getattr(TritonMLAImpl, name)
        monkeypatch.setattr(TritonMLAImpl, name,
                            lambda self, *a, _n=name, _r=real: calls.append(_n) or _r(self, *a))
    expanded = min(ctx) * H * min(N, V)
    biggest: list[int] = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape != cache.shape:
                    biggest.append(t.numel())
            return result

    md = TritonMLABackend.get_metadata_builder(torch.device(DEVICE)).build(common)
    q = torch.randn(3, H, N + R, generator=gen).to(DEVICE)
    dev = new_latents.float().to(DEVICE)
    with Sizes():
        out = impl.forward(q[..., :N], q[..., N:], dev[:, :L], dev[:, L:], cache, md)
    assert calls == ["_decode"] and out.shape == (3, H, V) and torch.isfinite(out).all()
    assert biggest and max(biggest) < expanded


def test_graph_padding_requests_read_and_write_nothing():
    """Decode CUDA graphs pad the batch with requests of seq_len 0 and slot -1: their rows come out 0."""
    import dataclasses

    gen = torch.Generator().manual_seed(13)
    _, new_latents, common, cache = make_step((5, 9), (1, 1), 4, gen)
    dev = torch.device(DEVICE)
    padded = dataclasses.replace(
        common,
        query_start_loc=torch.arange(5, dtype=torch.int32, device=dev),
        query_start_loc_cpu=torch.arange(5, dtype=torch.int32),
        seq_lens=torch.tensor([6, 10, 0, 0], dtype=torch.int32, device=dev),
        seq_lens_cpu=torch.tensor([6, 10, 0, 0], dtype=torch.int32),
        block_table=torch.cat((common.block_table, torch.zeros_like(common.block_table))),
        slot_mapping=torch.cat((common.slot_mapping, torch.full((2,), -1, device=dev))), num_reqs=4,
        num_actual_tokens=4,
    )
    impl = TritonMLAImpl(mla_layer(4), decode_splits=2)
    impl.process_weights_after_loading(torch.randn(H, N, L, generator=gen).to(DEVICE),
                                       torch.randn(H, V, L, generator=gen).to(DEVICE))
    before = cache.clone()
    md = TritonMLABackend.get_metadata_builder(dev).build(padded)
    rows = torch.cat((new_latents.float(), torch.randn(2, L + R, generator=gen, dtype=torch.float64).float()))
    q = torch.randn(4, H, N + R, generator=gen).to(DEVICE)
    out = impl.forward(q[..., :N], q[..., N:], rows[:, :L].to(DEVICE), rows[:, L:].to(DEVICE), cache, md)
    assert torch.isfinite(out[:2]).all() and torch.equal(out[2:].cpu(), torch.zeros(2, H, V))
    changed = ~(torch.isclose(cache, before) | (cache.isnan() & before.isnan()))
    assert int(changed.any(-1).sum()) == 2  # only the two real tokens' slots


def test_a_query_folded_beforehand_is_the_forward_without_it():
    """The MLA layer may fold q_nope through W_UK itself (`fold_query`, on a side stream inside a graph capture)
    and pass it as `q_c`: the forward's output is then the one it computes alone, bit for bit."""
    outs = []
    for folded in (False, True):
        latents, new_latents, common, cache = make_step([5, 17], [1, 4], 4, torch.Generator().manual_seed(4))
        impl = TritonMLAImpl(mla_layer(4, torch.float32))
        w = torch.randn(H, N + V, L, generator=torch.Generator().manual_seed(5)) / L**0.5
        impl.process_weights_after_loading(w[:, :N].to(DEVICE), w[:, N:].to(DEVICE))
        md = TritonMLABackend.get_metadata_builder(torch.device(DEVICE)).build(common)
        q = torch.randn(new_latents.shape[0], H, N + R, generator=torch.Generator().manual_seed(6)).to(DEVICE)
        dev = new_latents.to(DEVICE, torch.float32)
        args = (q[..., :N], q[..., N:], dev[:, :L], dev[:, L:], cache.to(DEVICE, torch.float32), md)
        outs.append(impl.forward(*args, q_c=impl.fold_query(q[..., :N])) if folded else impl.forward(*args))
    assert torch.equal(outs[0], outs[1])
