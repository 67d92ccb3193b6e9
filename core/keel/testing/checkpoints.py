"""Tiny random-weight Hugging Face checkpoints for tests (nothing is ever downloaded).

`make_checkpoint("llama", tmp_path)` writes config.json + safetensors of a 2-layer model small enough
to build in milliseconds. Weights are re-drawn at O(1) scale (HF's 0.02-std init makes logits so
small that a wrong kernel could still pass a 1e-4 comparison) from a fixed seed, so two calls with
the same arguments write identical checkpoints.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

# arch -> (config class name, model class name) in transformers
ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    # embedding models: the base decoders (architectures LlamaModel / Qwen3Model), no LM head
    "llama-embed": ("LlamaConfig", "LlamaModel"),
    "qwen3-embed": ("Qwen3Config", "Qwen3Model"),
}

TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 300,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def tiny_config(arch: str, **overrides: Any) -> Any:
    """The transformers config object `make_checkpoint` would write, without writing anything."""
    import transformers

    key = arch.lower()
    if key not in ARCHS:
        raise ValueError(f"unknown test architecture {arch!r}; known: {sorted(ARCHS)}")
    config_cls = getattr(transformers, ARCHS[key][0])
    kwargs = {**TINY_CONFIG, **overrides}
    if "head_dim" not in overrides and ("hidden_size" in overrides or "num_attention_heads" in overrides):
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    return config_cls(**kwargs)


@torch.no_grad()
def _randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(torch.rand(p.shape, generator=generator) + 0.5)
        elif name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=generator))
        else:  # linear [out, in]: unit-variance outputs for unit-variance inputs
            p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1]))


def make_checkpoint(
    arch: str,
    path: str | Path,
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a float32 random checkpoint of `arch` ("llama", "mistral", "qwen2", "qwen3") to `path`.

    `config_overrides` go to the transformers config (e.g. `tie_word_embeddings=True`,
    `rope_scaling={...}`, `num_key_value_heads=1`, `attention_bias=True`). `max_shard_size` (e.g.
    "20KB") writes sharded safetensors with an index. Returns `path`.
    """
    import transformers

    config = tiny_config(arch, **config_overrides)
    model_cls = getattr(transformers, ARCHS[arch.lower()][1])
    model = model_cls(config).to(torch.float32)
    _randomize(model, torch.Generator().manual_seed(seed))
    if config.tie_word_embeddings and hasattr(model, "tie_weights"):
        model.tie_weights()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    return path
