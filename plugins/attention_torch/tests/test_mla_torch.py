"""torch_mla: selection rules, latent cache layout, and attention against a float64 expanded reference.

The reference expands every context token's K/V from its latent (never touching the paged cache);
torch_mla must agree on mixed batches -- decodes (absorbed), prefills and chunked prefills (expanded)
-- and must leave exactly cat(kv_c, k_pe) of each new token in its cache slot.
"""

from __future__ import annotations

import pytest
import torch
from keel_attention_torch.backend import TorchPagedAttentionBackend, UnsupportedLayerError
from keel_attention_torch.mla import TorchMLABackend, TorchMLAImpl

from keel.attention.backend import AttentionLayerConfig, BackendRequest
from keel.attention.metadata import CommonAttentionMetadata
from keel.kv_cache.spec import FullAttentionSpec, MLALatentSpec
from keel.layers.mla_attention import MLAAttentionImpl
from keel.plugins.loader import load_plugins

H, N, R, V, L, BS = 4, 16, 8, 16, 32, 4


def mla_layer(**kw) -> AttentionLayerConfig:
    fields = {
        "num_heads": H, "num_kv_heads": 1, "head_size": L + R, "scale": (N + R) ** -0.5, "dtype": torch.float32,
        "block_size": BS, "use_mla": True,
        "extra": (("kv_lora_rank", L), ("qk_nope_head_dim", N), ("qk_rope_head_dim", R), ("v_head_dim", V)),
    }
    return AttentionLayerConfig(**{**fields, **kw})


def test_registry_resolves_torch_mla():
    plugins = load_plugins(["attention-torch"])
    assert plugins.registry("attention_backend").get("torch_mla") is TorchMLABackend


def test_validate_accepts_mla_and_rejects_the_rest():
    assert TorchMLABackend.validate(BackendRequest(mla_layer(), "cpu", "mla_latent")) == []
    plain = AttentionLayerConfig(num_heads=4, num_kv_heads=2, head_size=16, scale=0.25,
                                 dtype=torch.float32, block_size=BS)
    assert TorchMLABackend.validate(BackendRequest(plain, "cpu", "full_attention"))
    assert TorchMLABackend.validate(BackendRequest(mla_layer(), "cpu", "full_attention"))
    assert any("head_size" in r for r in TorchMLABackend.validate(
        BackendRequest(mla_layer(head_size=L), "cpu", "mla_latent")))
    assert any("extra" in r for r in TorchMLABackend.validate(
        BackendRequest(mla_layer(extra=()), "cpu", "mla_latent")))
    # ... and the standard backend declines MLA, so "auto" selection lands on torch_mla.
    assert TorchPagedAttentionBackend.validate(BackendRequest(mla_layer(), "cpu", "mla_latent"))
    with pytest.raises(UnsupportedLayerError):
        TorchMLABackend.get_impl(mla_layer(num_kv_heads=2))


def test_kv_cache_shape_is_one_latent_per_token():
    spec = MLALatentSpec(BS, torch.float32, kv_lora_rank=L, qk_rope_head_dim=R)
    shape = TorchMLABackend.kv_cache_shape(7, spec)
    assert shape == (7, BS, L + R)
    assert torch.Size(shape).numel() * 4 == 7 * spec.page_size_bytes
    with pytest.raises(UnsupportedLayerError):
        TorchMLABackend.kv_cache_shape(7, FullAttentionSpec(BS, torch.float32, 1, L + R))


def test_impl_satisfies_protocol_and_needs_weights():
    impl = TorchMLABackend.get_impl(mla_layer())
    assert isinstance(impl, MLAAttentionImpl)
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        impl.forward(torch.zeros(1, H, N), torch.zeros(1, H, R), torch.zeros(1, L), torch.zeros(1, R),
                     torch.zeros(2, BS, L + R), None)


def _step(context_lens, query_lens, gen):
    """Random latents for each request's full context, a block table, and the step's metadata."""
    totals = [c + q for c, q in zip(context_lens, query_lens)]
    blocks = [-(-t // BS) for t in totals]
    perm = (torch.randperm(sum(blocks), generator=gen) + 1).tolist()  # scattered, never the null block
    table = torch.zeros(len(totals), max(blocks), dtype=torch.int32)
    for i, nb in enumerate(blocks):
        table[i, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
    latents = [torch.randn(t, L + R, generator=gen, dtype=torch.float64) for t in totals]
    rows, slots, positions = [], [], []
    for i, (c, t) in enumerate(zip(context_lens, totals)):
        for p in range(c, t):
            positions.append(p)
            slots.append(int(table[i, p // BS]) * BS + p % BS)
            rows.append(latents[i][p])
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(totals, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens, seq_lens_cpu=seq_lens,
        block_table=table, slot_mapping=torch.tensor(slots), num_reqs=len(totals),
        num_actual_tokens=len(slots), max_query_len=max(query_lens), max_seq_len=max(totals), block_size=BS,
    )
    cache = torch.randn(sum(blocks) + 1, BS, L + R, generator=gen)  # garbage where nothing was written
    for i, (c, t) in enumerate(zip(context_lens, totals)):
        for p in range(c):  # earlier steps wrote the context
            cache[table[i, p // BS], p % BS] = latents[i][p].float()
    return latents, torch.stack(rows), common, cache


def _reference(q, latents, context_lens, query_lens, w_uk, w_uv, scale):  # float64, fully expanded
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


@pytest.mark.parametrize(
    "context_lens,query_lens",
    [
        ((0, 17, 0, 40, 9), (21, 1, 6, 1, 5)),  # mixed: prefill, decode, chunk
        ((0, 5, 31, 16), (1, 1, 1, 1)),  # pure decode
        ((12, 3), (9, 4)),  # chunked prefill over a cached prefix
    ],
)
def test_forward_matches_expanded_reference(context_lens, query_lens):
    gen = torch.Generator().manual_seed(sum(context_lens) + len(query_lens))
    latents, new_latents, common, cache = _step(context_lens, query_lens, gen)
    w_uk = torch.randn(H, N, L, generator=gen, dtype=torch.float64) / L**0.5
    w_uv = torch.randn(H, V, L, generator=gen, dtype=torch.float64) / L**0.5
    q = torch.randn(common.num_actual_tokens, H, N + R, generator=gen, dtype=torch.float64)
    layer = mla_layer()
    impl = TorchMLABackend.get_impl(layer)
    impl.process_weights_after_loading(w_uk.float(), w_uv.float())
    md = TorchMLABackend.get_metadata_builder(torch.device("cpu")).build(common)
    qf = q.float()
    out = impl.forward(qf[..., :N], qf[..., N:], new_latents[:, :L].float(), new_latents[:, L:].float(),
                       cache, md)
    ref = _reference(q, latents, context_lens, query_lens, w_uk, w_uv, layer.scale)
    assert out.shape == (common.num_actual_tokens, H, V)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
    written = cache.view(-1, L + R)[common.slot_mapping]
    torch.testing.assert_close(written.double(), new_latents, atol=1e-6, rtol=0)


def test_decode_is_absorbed_and_never_expands(monkeypatch):
    gen = torch.Generator().manual_seed(7)
    _latents, new_latents, common, cache = _step((5, 31, 16), (1, 1, 1), gen)
    impl = TorchMLABackend.get_impl(mla_layer())
    impl.process_weights_after_loading(torch.randn(H, N, L, generator=gen), torch.randn(H, V, L, generator=gen))

    def no_expansion(*args, **kwargs):
        raise AssertionError("decode expanded K/V from the cache")

    monkeypatch.setattr(TorchMLAImpl, "_prefill_expanded", no_expansion)
    calls = []
    absorbed = TorchMLAImpl._decode_absorbed
    monkeypatch.setattr(TorchMLAImpl, "_decode_absorbed", lambda self, *a: calls.append(1) or absorbed(self, *a))
    md = TorchMLABackend.get_metadata_builder(torch.device("cpu")).build(common)
    q = torch.randn(3, H, N + R, generator=gen)
    out = impl.forward(q[..., :N], q[..., N:], new_latents[:, :L].float(), new_latents[:, L:].float(),
                       cache, md)
    assert calls == [1] and out.shape == (3, H, V) and torch.isfinite(out).all()
