"""MLAAttention: multi-head latent attention (DeepSeek-V2/V3) over a latent KV cache.

The layer owns the MLA-specific wiring; the math over the paged cache belongs to an MLA backend found by
key through `ModelBuildContext.backend_for(layer_config, "mla_latent")` (`torch_mla` anywhere; a Triton
`triton_mla` can be registered later without touching this file).

Shapes: H heads, N = qk_nope_head_dim, R = qk_rope_head_dim, V = v_head_dim, L = kv_lora_rank.
`kv_b_proj.weight` [H * (N + V), L] viewed as [H, N + V, L] splits into
W_UK [H, N, L] (latent -> per-head nope key) and W_UV [H, V, L] (latent -> per-head value).

Forward contract between this layer and an MLA backend implementation (`MLAAttentionImpl`)
------------------------------------------------------------------------------------------
Layer config the backend is selected and built with: `AttentionLayerConfig(num_heads=H, num_kv_heads=1,
head_size=L + R, scale=s, use_mla=True, extra=(("kv_lora_rank", L), ("qk_nope_head_dim", N),
("qk_rope_head_dim", R), ("v_head_dim", V)))`; KV cache spec `MLALatentSpec(kv_lora_rank=L,
qk_rope_head_dim=R)`, kind "mla_latent". `head_size` is what the absorbed (decode) kernel sees: one
shared key/value "head" of size L + R.

1. Once, after the model's weights are loaded, the layer calls
   `impl.process_weights_after_loading(w_uk [H, N, L], w_uv [H, V, L])` (model dtype, model device).
   The impl may keep them, pre-transpose or fuse them; it must not assume they are contiguous. It is
   called again when weights are reloaded into a running model: derived copies are then updated in
   place, so CUDA graphs captured earlier read the new values.
2. Every step the layer calls `impl.forward(q, kv_c, k_pe, kv_cache, metadata) -> out` with
   - q:     [T, H, N + R]  the query, nope part first, rope part already rotated;
   - kv_c:  [T, L]         the new tokens' normalized latent (kv_a_layernorm applied);
   - k_pe:  [T, R]         the new tokens' shared rope key, already rotated with the same layout as q's;
   - kv_cache: the layer's tensor of shape `backend.kv_cache_shape(num_blocks, spec)`; the standard
     layout is [num_blocks, block_size, L + R], each slot holding cat(kv_c, k_pe) of one token;
   - metadata: what the backend's builder returned for this step (from `CommonAttentionMetadata`);
   and gets out: [T, H, V], the attention output per head *after* W_UV (o_proj input).
   The impl first writes cat(kv_c, k_pe) of every real token with slot_mapping >= 0 into its slot,
   then computes, for each new token, softmax(s * q . k) v over its request's context (causal within
   the new tokens), where k = cat(W_UK kv_c, k_pe) and v = W_UV kv_c of the context tokens.
   Guarantees asked of the impl: the cache only ever holds latents (never expanded K/V); requests
   with one new token (decode) are computed in the absorbed form -- q_nope is folded through W_UK into
   latent space, attention runs over the cached latents as a single shared head, W_UV is applied to
   the result -- so decode never expands the cache; requests with several new tokens (prefill, chunked
   prefill) may expand K/V from the latents of their own context. Rows past num_actual_tokens are
   padding: unspecified but finite.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from keel.attention.backend import AttentionLayerConfig
from keel.forward_context import ForwardContext
from keel.kv_cache.spec import MLALatentSpec
from keel.layers.kv_scales import register_kv_scales
from keel.models.interface import ModelBuildContext


@runtime_checkable
class MLAAttentionImpl(Protocol):
    """What an MLA backend's `get_impl(layer_config)` returns; called only by `MLAAttention`."""

    def process_weights_after_loading(
        self,
        w_uk: torch.Tensor,  # [H, N, L]
        w_uv: torch.Tensor,  # [H, V, L]
    ) -> None:
        """Called once after weight loading (see the module docstring, step 1)."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, H, N + R]
        kv_c: torch.Tensor,  # [T, L]
        k_pe: torch.Tensor,  # [T, R]
        kv_cache: torch.Tensor,  # backend.kv_cache_shape(...), standard [num_blocks, block_size, L + R]
        metadata: Any,
    ) -> torch.Tensor:  # [T, H, V]
        """Called every step (see the module docstring, step 2)."""
        ...


class MLAAttention(nn.Module):
    """Paged latent attention for one layer. `layer_idx` indexes the ForwardContext.

    Built by the model's attention module, which owns the projections (including kv_b_proj) and the
    rotary embedding; this layer owns only the backend impl and the KV cache spec.
    """

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        scale: float,
        build: ModelBuildContext,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.config = AttentionLayerConfig(
            num_heads=num_heads,
            num_kv_heads=1,
            head_size=kv_lora_rank + qk_rope_head_dim,
            scale=scale,
            dtype=build.dtype,
            block_size=build.block_size,
            use_mla=True,
            extra=(
                ("kv_lora_rank", kv_lora_rank),
                ("qk_nope_head_dim", qk_nope_head_dim),
                ("qk_rope_head_dim", qk_rope_head_dim),
                ("v_head_dim", v_head_dim),
            ),
            kv_cache_dtype=build.kv_cache_dtype,
        )
        self.backend = build.backend_for(self.config, self.kv_cache_spec().kind)
        self.impl: MLAAttentionImpl = self.backend.get_impl(self.config)
        if self.config.cache_dtype != self.config.dtype:
            register_kv_scales(self, self.impl, self.backend.name)  # the latent cache reads k_scale

    def kv_cache_spec(self) -> MLALatentSpec:
        c = self.config
        return MLALatentSpec(
            c.block_size, c.cache_dtype, kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim
        )

    def process_weights_after_loading(
        self,
        kv_b_weight: torch.Tensor,  # [H * (N + V), L], the loaded kv_b_proj weight
    ) -> None:
        """Called by the model once its weights are loaded: hands W_UK / W_UV to the impl."""
        h, n, v, lora = self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
        if tuple(kv_b_weight.shape) != (h * (n + v), lora):
            raise ValueError(
                f"kv_b_proj weight has shape {tuple(kv_b_weight.shape)}, expected {(h * (n + v), lora)} "
                f"(heads={h}, qk_nope_head_dim={n}, v_head_dim={v}, kv_lora_rank={lora})"
            )
        w = kv_b_weight.detach().view(h, n + v, lora)
        self.impl.process_weights_after_loading(w[:, :n], w[:, n:])

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, H * (N + R)], rope part rotated
        kv_c: torch.Tensor,  # [num_tokens, L], normalized
        k_pe: torch.Tensor,  # [num_tokens, R], rotated
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [num_tokens, H * V]
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        out = self.impl.forward(
            q, kv_c, k_pe, ctx.kv_caches[self.layer_idx], ctx.attn_metadata[self.layer_idx]
        )
        return out.reshape(n, self.num_heads * self.v_head_dim)
