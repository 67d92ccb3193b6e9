"""Rotary position embeddings (neox / HF-Llama style) with the common scaling schemes.

A `RotaryEmbedding` precomputes a cos/sin cache in float32 for positions [0, max_position) and
applies it to flattened q/k ([num_tokens, heads * head_size]) at the given positions. Scaling types
follow HF's `rope_type`: default, linear, dynamic, llama3, yarn. `get_rope_parameters` reads a config
whether its rope settings live in `rope_parameters` (transformers 5.x), `rope_scaling` (4.x) or
top-level attributes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import nn


class UnsupportedRopeError(ValueError):
    """The config asks for a rope type keel does not implement."""


def get_rope_parameters(config: Any) -> dict[str, Any]:
    """Normalized rope settings of an HF config: always has `rope_type` and `rope_theta`.

    Called by model builders. transformers 5.x stores everything (theta included) in
    `config.rope_parameters`; 4.x keeps `rope_theta` top-level and scaling in `rope_scaling` whose type
    key may be the legacy `type`.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    if params.get("partial_rotary_factor") is None:
        params["partial_rotary_factor"] = getattr(config, "partial_rotary_factor", None) or 1.0
    if params["rope_type"] in ("llama3", "yarn") and params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = getattr(
            config, "original_max_position_embeddings", config.max_position_embeddings
        )
    return params


def _default_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:  # [rotary_dim // 2] float32
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(base: float, rotary_dim: int, p: dict[str, Any]) -> torch.Tensor:
    inv_freq = _default_inv_freq(base, rotary_dim)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(base: float, rotary_dim: int, p: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = p["factor"]
    orig = p["original_max_position_embeddings"]
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).to(torch.float32) / rotary_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def compute_inv_freq(
    rope: dict[str, Any], rotary_dim: int, max_position: int
) -> tuple[torch.Tensor, float, int]:
    """(inv_freq [rotary_dim // 2] float32, cos/sin scale, cache length) for normalized `rope` params."""
    rope_type, base = rope["rope_type"], float(rope["rope_theta"])
    if rope_type == "default":
        return _default_inv_freq(base, rotary_dim), 1.0, max_position
    if rope_type == "linear":
        return _default_inv_freq(base, rotary_dim) / rope["factor"], 1.0, max_position
    if rope_type == "dynamic":
        # A static cache cannot follow HF's per-batch rescaling; like vLLM, fix the base for the
        # longest context the scaling allows (max_position * factor).
        factor = rope["factor"]
        max_len = int(max_position * factor)
        base = base * ((factor * max_len / max_position) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        return _default_inv_freq(base, rotary_dim), 1.0, max_len
    if rope_type == "llama3":
        return _llama3_inv_freq(base, rotary_dim, rope), 1.0, max_position
    if rope_type == "yarn":
        inv_freq, scale = _yarn_inv_freq(base, rotary_dim, rope)
        cache_len = max(max_position, int(rope["original_max_position_embeddings"] * rope["factor"]))
        return inv_freq, scale, cache_len
    raise UnsupportedRopeError(
        f"rope_type {rope_type!r} is not supported; known: default, linear, dynamic, llama3, yarn"
    )


def _rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, heads, rotary_dim]; cos/sin: [num_tokens, 1, rotary_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RotaryEmbedding(nn.Module):
    """Neox-style rope on the first `rotary_dim` dims of each head.

    Built by the model's attention layer; `forward(positions, q, k)` is called every step and returns
    rotated copies. Positions must lie in [0, cache_len); the cache is a non-persistent buffer, so it
    is never expected in (or saved to) a checkpoint. The worker may bind a fused `rotary_embedding`
    kernel (see `keel.layers.custom_op`); it receives this layer's caches.
    """

    custom_ops: ClassVar[tuple[str, ...]] = ("rotary_embedding",)
    bound_ops: Mapping[str, Callable[..., Any]] = MappingProxyType({})

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, rope: dict[str, Any]) -> None:
        super().__init__()
        if rotary_dim > head_size or rotary_dim % 2:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_size {head_size}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        device = torch.get_default_device()
        # Computed on CPU in float32 whatever the build's default device/dtype, to match HF bit for bit.
        with torch.device("cpu"):
            inv_freq, scale, cache_len = compute_inv_freq(rope, rotary_dim, max_position)
            t = torch.arange(cache_len, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)  # [cache_len, rotary_dim]
        self.cache_len = cache_len
        self.register_buffer("cos_cache", (emb.cos() * scale).to(device), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * scale).to(device), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        q: torch.Tensor,  # [num_tokens, num_heads * head_size]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        op = self.bound_ops.get("rotary_embedding")
        if op is not None:
            return op(positions, q, k, self.cos_cache, self.sin_cache, self.head_size, self.rotary_dim)
        # HF rotates in the activation dtype with cos/sin cast down from float32; do the same.
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        x = x.view(n, -1, self.head_size)
        rot = _rotate_neox(x[..., : self.rotary_dim], cos, sin)
        if self.rotary_dim < self.head_size:
            rot = torch.cat((rot, x[..., self.rotary_dim :]), dim=-1)
        return rot.reshape(n, -1)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, cache_len={self.cache_len}"


def get_rope(head_size: int, max_position: int, rope: dict[str, Any]) -> RotaryEmbedding:
    """A rotary embedding for normalized params from `get_rope_parameters` (vLLM's `get_rope`)."""
    rotary_dim = int(head_size * float(rope.get("partial_rotary_factor") or 1.0))
    return RotaryEmbedding(head_size, rotary_dim, max_position, rope)
