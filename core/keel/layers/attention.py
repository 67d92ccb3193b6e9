"""The attention layer models use: owns its backend implementation and declares its KV cache spec."""

from __future__ import annotations

import torch
from torch import nn

from keel.attention.backend import AttentionLayerConfig
from keel.forward_context import ForwardContext
from keel.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from keel.layers.kv_scales import register_kv_scales
from keel.layers.rotary import RotaryEmbedding
from keel.models.interface import ModelBuildContext


class Attention(nn.Module):
    """Paged attention over the step's varlen batch. `layer_idx` indexes the ForwardContext.

    A model may hand the layer its rope (`forward(..., rotary=, positions=)`) instead of rotating q and k
    itself. An impl that offers `write_kv_rope(q, k, v, positions, cos_cache, sin_cache, rotary_dim, kv_cache,
    metadata) -> q_rotated` (the rope and the cache write in one launch: k written rotated, the inputs left as
    they were, out of place as custom ops are) then does both, and the layer passes
    `forward(q_rotated, k, v, ..., kv_written=True)`; otherwise the rope module runs first, as before.
    """

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        build: ModelBuildContext,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.config = AttentionLayerConfig(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            scale=scale,
            dtype=build.dtype,
            block_size=build.block_size,
            sliding_window=sliding_window,
            kv_cache_dtype=build.kv_cache_dtype,
        )
        self.backend = build.backend_for(self.config, self.kv_cache_spec().kind)
        self.impl = self.backend.get_impl(self.config)
        if self.config.cache_dtype != self.config.dtype:
            register_kv_scales(self, self.impl, self.backend.name)

    def kv_cache_spec(self) -> KVCacheSpec:
        c = self.config
        if c.sliding_window is not None:
            return SlidingWindowSpec(c.block_size, c.cache_dtype, c.num_kv_heads, c.head_size, c.sliding_window)
        return FullAttentionSpec(c.block_size, c.cache_dtype, c.num_kv_heads, c.head_size)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_size]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        ctx: ForwardContext,
        rotary: RotaryEmbedding | None = None,  # the model's rope for q and k, applied here
        positions: torch.Tensor | None = None,  # [num_tokens] int64, with `rotary`
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
        n = q.shape[0]
        kv_cache, metadata = ctx.kv_caches[self.layer_idx], ctx.attn_metadata[self.layer_idx]
        fused = getattr(self.impl, "write_kv_rope", None) if rotary is not None else None
        if rotary is not None and fused is None:
            q, k = rotary(positions, q, k)
        q = q.view(n, self.num_heads, self.head_size)
        k = k.view(n, self.num_kv_heads, self.head_size)
        v = v.view(n, self.num_kv_heads, self.head_size)
        if fused is not None:
            q = fused(q, k, v, positions, rotary.cos_cache, rotary.sin_cache, rotary.rotary_dim, kv_cache, metadata)
            out = self.impl.forward(q, k, v, kv_cache, metadata, kv_written=True)
        else:
            out = self.impl.forward(q, k, v, kv_cache, metadata)
        return out.reshape(n, self.num_heads * self.head_size)
