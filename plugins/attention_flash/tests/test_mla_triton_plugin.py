"""triton_mla as a plugin component: registration, validation, cache shape, and where `auto` lands."""

from __future__ import annotations

import pytest
import torch
from keel_attention_flash.backend import UnsupportedLayerError
from keel_attention_flash.mla_backend import TritonMLABackend

from keel.attention.backend import AttentionLayerConfig, BackendRequest
from keel.attention.selector import select_attention_backend
from keel.kv_cache.spec import FullAttentionSpec, MLALatentSpec
from keel.layers.mla_attention import MLAAttentionImpl
from keel.plugins.loader import load_plugins

H, N, R, V, L, BS = 4, 16, 8, 16, 32, 16


def mla_layer(**kw) -> AttentionLayerConfig:
    fields = {
        "num_heads": H, "num_kv_heads": 1, "head_size": L + R, "scale": (N + R) ** -0.5,
        "dtype": torch.float32, "block_size": BS, "use_mla": True,
        "extra": (("kv_lora_rank", L), ("qk_nope_head_dim", N), ("qk_rope_head_dim", R), ("v_head_dim", V)),
    }
    return AttentionLayerConfig(**{**fields, **kw})


def test_registry_resolves_triton_mla():
    plugins = load_plugins(["attention-flash"])
    assert plugins.registry("attention_backend").get("triton_mla") is TritonMLABackend
    assert TritonMLABackend.supports_cuda_graph and TritonMLABackend.capabilities.supports_mla


def test_validate_accepts_mla_and_rejects_the_rest(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert TritonMLABackend.validate(BackendRequest(mla_layer(dtype=dtype), "cuda", "mla_latent")) == []
    assert TritonMLABackend.validate(BackendRequest(mla_layer(), "cpu", "mla_latent")) == []
    plain = AttentionLayerConfig(num_heads=4, num_kv_heads=2, head_size=16, scale=0.25,
                                 dtype=torch.float32, block_size=BS)
    assert TritonMLABackend.validate(BackendRequest(plain, "cuda", "full_attention"))
    assert TritonMLABackend.validate(BackendRequest(mla_layer(), "cuda", "full_attention"))
    assert TritonMLABackend.validate(BackendRequest(mla_layer(block_size=3), "cuda", "mla_latent"))
    assert TritonMLABackend.validate(BackendRequest(mla_layer(dtype=torch.float64), "cuda", "mla_latent"))
    assert any("head_size" in r for r in TritonMLABackend.validate(
        BackendRequest(mla_layer(head_size=L), "cuda", "mla_latent")))
    assert any("extra" in r for r in TritonMLABackend.validate(
        BackendRequest(mla_layer(extra=()), "cuda", "mla_latent")))
    with pytest.raises(UnsupportedLayerError, match="num_kv_heads"):
        TritonMLABackend.get_impl(mla_layer(num_kv_heads=2))


def test_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reasons = TritonMLABackend.validate(BackendRequest(mla_layer(), "cpu", "mla_latent"))
    assert any("TRITON_INTERPRET=1" in r for r in reasons)
    assert TritonMLABackend.validate(BackendRequest(mla_layer(), "cuda", "mla_latent")) == []


def test_kv_cache_shape_is_one_latent_per_token():
    spec = MLALatentSpec(BS, torch.bfloat16, kv_lora_rank=L, qk_rope_head_dim=R)
    shape = TritonMLABackend.kv_cache_shape(7, spec)
    assert shape == (7, BS, L + R)
    assert torch.Size(shape).numel() * 2 == 7 * spec.page_size_bytes
    with pytest.raises(UnsupportedLayerError, match="latents"):
        TritonMLABackend.kv_cache_shape(7, FullAttentionSpec(BS, torch.float32, 1, L + R))


def test_impl_satisfies_protocol_and_needs_weights():
    impl = TritonMLABackend.get_impl(mla_layer())
    assert isinstance(impl, MLAAttentionImpl)
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        impl.forward(torch.zeros(1, H, N), torch.zeros(1, H, R), torch.zeros(1, L), torch.zeros(1, R),
                     torch.zeros(2, BS, L + R), None)


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_auto_keeps_torch_mla_on_cpu_and_picks_triton_mla_on_cuda(monkeypatch, interpret):
    from keel_platform_cpu.platform import CpuPlatform
    from keel_platform_cuda.platform import CudaPlatform

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    plugins = load_plugins("auto")  # every installed plugin, in discovery order
    request = BackendRequest(mla_layer(), "cpu", "mla_latent")
    assert select_attention_backend(CpuPlatform(), request, "auto", plugins).name == "torch_mla"
    request = BackendRequest(mla_layer(dtype=torch.bfloat16), "cuda", "mla_latent")
    assert select_attention_backend(CudaPlatform(), request, "auto", plugins).name == "triton_mla"
    plain = BackendRequest(mla_layer(use_mla=False, num_kv_heads=4, head_size=64, extra=()), "cuda",
                           "full_attention")
    assert select_attention_backend(CudaPlatform(), plain, "auto", plugins).name == "triton_flash"


def test_metadata_splits_decodes_from_prefills_and_tiles_prefills():
    from keel.attention.metadata import CommonAttentionMetadata

    def common(query_lens, seq_lens):
        qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, seq_lens_cpu=seq,
            block_table=torch.zeros(len(seq_lens), 4, dtype=torch.int32),
            slot_mapping=torch.zeros(int(qsl[-1]) + 2, dtype=torch.int64), num_reqs=len(seq_lens),
            num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            block_size=BS,
        )

    builder = TritonMLABackend.get_metadata_builder(torch.device("cpu"))
    decode = builder.build(common([1, 1, 1], [5, 9, 1]))
    assert decode.is_decode and decode.decode_reqs is None and decode.num_decodes == 3
    assert decode.prefill_reqs == [] and decode.num_query_rows == 3
    mixed = builder.build(common([5, 1, 0, 9, 1], [5, 20, 3, 12, 2]))
    assert not mixed.is_decode and mixed.decode_reqs.tolist() == [1, 4] and mixed.num_decodes == 2
    assert mixed.prefill_reqs == [0, 3]  # a request without new tokens is neither
    tile_req, tile_q0 = mixed.prefill_tiles(4)
    assert tile_req.tolist() == [0, 0, 3, 3, 3] and tile_q0.tolist() == [0, 4, 0, 4, 8]
    assert mixed.prefill_tiles(4)[0] is tile_req  # computed once per tile height and step


def test_reloaded_weights_update_the_kept_tensors_in_place():
    """A second process_weights_after_loading (weights reloaded into a running model) writes into the
    tensors the first one made, so CUDA graphs captured in between read the new weights."""
    from keel_attention_flash.mla_impl import TritonMLAImpl

    from keel.attention.backend import AttentionLayerConfig

    h, n, r, v, lora = 2, 8, 4, 8, 16
    layer = AttentionLayerConfig(num_heads=h, num_kv_heads=1, head_size=lora + r, scale=0.1, use_mla=True,
                                 dtype=torch.float32, block_size=16, extra=(("kv_lora_rank", lora), ("qk_nope_head_dim", n), ("qk_rope_head_dim", r),
                                        ("v_head_dim", v)))
    impl = TritonMLAImpl(layer)
    impl.process_weights_after_loading(torch.randn(h, n, lora), torch.randn(h, v, lora))
    kept_uk, kept_uv_t = impl.w_uk, impl.w_uv_t
    w_uk, w_uv = torch.randn(h, n, lora), torch.randn(h, v, lora)
    impl.process_weights_after_loading(w_uk, w_uv)
    assert impl.w_uk is kept_uk and impl.w_uv_t is kept_uv_t
    assert torch.equal(impl.w_uk, w_uk) and torch.equal(impl.w_uv_t, w_uv.transpose(1, 2))
