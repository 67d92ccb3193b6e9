"""keel.testing.checkpoints: deterministic tiny checkpoints with the requested shape of model."""

from __future__ import annotations

import json

import pytest
import torch

from keel.models.loader import iterate_safetensors
from keel.testing.checkpoints import make_checkpoint, tiny_config


def test_same_seed_same_weights_other_seed_differs(tmp_path) -> None:
    a = dict(iterate_safetensors(make_checkpoint("mistral", tmp_path / "a")))
    b = dict(iterate_safetensors(make_checkpoint("mistral", tmp_path / "b")))
    c = dict(iterate_safetensors(make_checkpoint("mistral", tmp_path / "c", seed=1)))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert {t.dtype for t in a.values()} == {torch.float32}


def test_tiny_shapes_gqa_and_tying(tmp_path) -> None:
    path = make_checkpoint("qwen3", tmp_path / "q", tie_word_embeddings=True)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (64, 2, 300)
    state = dict(iterate_safetensors(path))
    assert "lm_head.weight" not in state
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)  # 2 KV heads of 16
    assert state["model.layers.0.self_attn.q_norm.weight"].shape == (16,)


def test_head_dim_follows_overridden_heads() -> None:
    assert tiny_config("llama", num_attention_heads=8).head_dim == 8
    assert tiny_config("llama", num_attention_heads=8, head_dim=32).head_dim == 32


def test_unknown_arch() -> None:
    with pytest.raises(ValueError, match="known"):
        tiny_config("gpt2")
