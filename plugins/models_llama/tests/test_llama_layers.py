"""Hardware-neutral layers against their transformers counterparts and reference formulas."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from keel.layers.activation import GeluAndMul, SiluAndMul, UnsupportedActivationError, get_act_and_mul_fn
from keel.layers.layernorm import RMSNorm
from keel.layers.rotary import UnsupportedRopeError, compute_inv_freq, get_rope, get_rope_parameters

g = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf_and_fuses_residual(dtype: torch.dtype) -> None:
    x, res, w = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g), torch.rand(32, generator=g)
    ours, ref = RMSNorm(32, 1e-5).to(dtype), LlamaRMSNorm(32, 1e-5).to(dtype)
    ours.weight.data.copy_(w)
    ref.weight.data.copy_(w)
    x, res = x.to(dtype), res.to(dtype)
    torch.testing.assert_close(ours(x), ref(x), atol=0, rtol=0)
    normed, new_res = ours(x, res)
    torch.testing.assert_close(new_res, x + res, atol=0, rtol=0)
    torch.testing.assert_close(normed, ref(x + res), atol=0, rtol=0)


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "yarn-mscale": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
    },
}


@pytest.mark.parametrize("name", list(ROPES))
def test_rotary_matches_hf(name: str) -> None:
    head, heads, kv_heads = 16, 4, 2
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=heads, head_dim=head, max_position_embeddings=256,
        rope_parameters=dict(ROPES[name]),
    )  # fmt: skip
    positions = torch.tensor([0, 1, 5, 31, 32, 100, 255])
    q, k = torch.randn(7, heads * head, generator=g), torch.randn(7, kv_heads * head, generator=g)
    cos, sin = LlamaRotaryEmbedding(config)(q[None], positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(
        q.view(1, 7, heads, head).transpose(1, 2),
        k.view(1, 7, kv_heads, head).transpose(1, 2),
        cos,
        sin,
    )
    rope = get_rope(head, 256, get_rope_parameters(config))
    ours_q, ours_k = rope(positions, q, k)
    torch.testing.assert_close(ours_q, ref_q.transpose(1, 2).reshape(7, -1), atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_k, ref_k.transpose(1, 2).reshape(7, -1), atol=1e-6, rtol=0)


def test_dynamic_ntk_fixes_the_base_for_the_scaled_context() -> None:
    inv_freq, scale, cache_len = compute_inv_freq(
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 16, 64
    )
    base = 10000.0 * (2.0 * 128 / 64 - 1.0) ** (16 / 14)
    expected = 1.0 / base ** (torch.arange(0, 16, 2).float() / 16)
    torch.testing.assert_close(inv_freq, expected)
    assert (scale, cache_len) == (1.0, 128)


def test_partial_rotary_leaves_tail_untouched() -> None:
    rope = get_rope(16, 32, {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    assert rope.rotary_dim == 8
    q, k = torch.randn(3, 32, generator=g), torch.randn(3, 16, generator=g)
    rq, rk = rope(torch.tensor([0, 4, 9]), q, k)
    torch.testing.assert_close(rq.view(3, 2, 16)[..., 8:], q.view(3, 2, 16)[..., 8:])
    torch.testing.assert_close(rq[0], q[0])  # position 0 is the identity rotation
    assert not torch.allclose(rk[1, :8], k[1, :8])


def test_rope_parameters_from_legacy_configs() -> None:
    legacy = SimpleNamespace(
        rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0}, max_position_embeddings=128
    )
    assert get_rope_parameters(legacy) == {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 1e6, "partial_rotary_factor": 1.0
    }  # fmt: skip
    bare = SimpleNamespace(max_position_embeddings=128)
    assert get_rope_parameters(bare)["rope_type"] == "default"
    assert get_rope_parameters(bare)["rope_theta"] == 10000.0
    llama3 = SimpleNamespace(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1, "high_freq_factor": 4},
        rope_theta=5e5,
        max_position_embeddings=2048,
    )
    assert get_rope_parameters(llama3)["original_max_position_embeddings"] == 2048


def test_rope_parameters_from_transformers_5_config() -> None:
    config = LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 3.0}, rope_theta=1234.0)
    params = get_rope_parameters(config)
    assert (params["rope_type"], params["factor"], params["rope_theta"]) == ("linear", 3.0, 1234.0)


def test_unknown_rope_type_is_a_typed_error() -> None:
    with pytest.raises(UnsupportedRopeError, match="longrope"):
        get_rope(16, 32, {"rope_type": "longrope", "rope_theta": 10000.0})


def test_gated_activations() -> None:
    x = torch.randn(3, 8, generator=g)
    torch.testing.assert_close(SiluAndMul()(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
    torch.testing.assert_close(GeluAndMul()(x), torch.nn.functional.gelu(x[:, :4]) * x[:, 4:])
    assert isinstance(get_act_and_mul_fn("silu"), SiluAndMul)
    with pytest.raises(UnsupportedActivationError, match="relu2"):
        get_act_and_mul_fn("relu2")
