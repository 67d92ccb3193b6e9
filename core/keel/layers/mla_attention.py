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
2. Every step the layer calls `impl.forward(q_nope, q_pe, kv_c, k_pe, kv_cache, metadata) -> out` with
   - q_nope: [T, H, N]     the query's nope part: a view into the q projection's output (row stride
     H * (N + R), head stride N + R, last dim contiguous) -- never concatenated with q_pe;
   - q_pe:  [T, H, R]      the query's rope part, rotated, contiguous;
   - kv_c:  [T, L]         the new tokens' normalized latent (kv_a_layernorm applied);
   - k_pe:  [T, R]         the new tokens' shared rope key, rotated with the same layout as q_pe, contiguous;
   - kv_cache: the layer's tensor of shape `backend.kv_cache_shape(num_blocks, spec)`; the standard
     layout is [num_blocks, block_size, L + R], each slot holding cat(kv_c, k_pe) of one token;
   - metadata: what the backend's builder returned for this step (from `CommonAttentionMetadata`);
   and gets out: [T, H, V], the attention output per head *after* W_UV (o_proj input).
   The impl first writes cat(kv_c, k_pe) of every real token with slot_mapping >= 0 into its slot,
   then computes, for each new token, softmax(s * q . k) v over its request's context (causal within
   the new tokens), where q = cat(q_nope, q_pe), k = cat(W_UK kv_c, k_pe) and v = W_UV kv_c of the
   context tokens.
   An impl may also offer `fold_query(q_nope [T, H, N]) -> q_c [T, H, L]` (q_nope through W_UK, what its
   forward would compute first); inside a CUDA graph capture the layer then calls it on a side stream beside
   the latent's norm and the rope, and passes the result as `forward(..., q_c=q_c)`, which must equal the
   forward without it.
   Guarantees asked of the impl: the cache only ever holds latents (never expanded K/V); requests
   with one new token (decode) are computed in the absorbed form -- q_nope is folded through W_UK into
   latent space, attention runs over the cached latents as a single shared head, W_UV is applied to
   the result -- so decode never expands the cache; requests with several new tokens (prefill, chunked
   prefill) may expand K/V from the latents of their own context. Rows past num_actual_tokens are
   padding: unspecified but finite.

Rope belongs to this layer: it gets the model's `RotaryEmbedding` (DeepSeek's neox rotation over the
R rope dims) and whether the checkpoint's rope dims are interleaved, and rotates the raw q projection's
rope part and the raw k_pe itself -- through the `mla_rope` custom op when one is bound (one kernel
reading q's rope part in place and writing q_pe and k_pe), else the torch reference below
(de-interleave copies, the rotary layer, its output); where `mla_rope_norm` is bound the same launch also
applies kv_a_layernorm to the latent. Either way q_nope is never copied: on an H200 the
reference path's concatenations and copies cost 4.4 ms of an 8192-token DeepSeek-V2-Lite prefill step.
Interleaved rope dims (DeepSeek-V2 always, V3 when `rope_interleave`) are de-interleaved (evens, then
odds) in q_pe and k_pe alike before the neox rotation; only q_pe . k_pe is ever used, so the
permutation changes nothing, and the rotation equals HF's `apply_rotary_pos_emb_interleave`. The
latent cache therefore stores k_pe de-interleaved.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from keel.attention.backend import AttentionLayerConfig
from keel.forward_context import ForwardContext
from keel.kv_cache.spec import MLALatentSpec
from keel.layers import side_stream
from keel.layers.kv_scales import register_kv_scales
from keel.layers.layernorm import RMSNorm
from keel.layers.rotary import RotaryEmbedding
from keel.models.interface import ModelBuildContext


def deinterleave(x: torch.Tensor) -> torch.Tensor:  # x: [..., R] -> [..., R] contiguous: evens then odds
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


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
        q_nope: torch.Tensor,  # [T, H, N], a strided view (row stride H * (N + R))
        q_pe: torch.Tensor,  # [T, H, R], rotated
        kv_c: torch.Tensor,  # [T, L]
        k_pe: torch.Tensor,  # [T, R], rotated
        kv_cache: torch.Tensor,  # backend.kv_cache_shape(...), standard [num_blocks, block_size, L + R]
        metadata: Any,
    ) -> torch.Tensor:  # [T, H, V]
        """Called every step (see the module docstring, step 2)."""
        ...


class MLAAttention(nn.Module):
    """Paged latent attention for one layer. `layer_idx` indexes the ForwardContext.

    Built by the model's attention module, which owns the projections (including kv_b_proj); this layer
    owns the backend impl, the KV cache spec and the rope of q and k_pe (`rotary_emb`, built by the
    model; see the module docstring). The worker may bind an `mla_rope` kernel, and an `mla_rope_norm` one
    that also applies the latent's RMSNorm (`keel.layers.custom_op`).
    """

    custom_ops: ClassVar[tuple[str, ...]] = ("mla_rope", "mla_rope_norm")
    bound_ops: Mapping[str, Callable[..., Any]] = MappingProxyType({})

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
        rotary_emb: RotaryEmbedding,
        rope_interleaved: bool,
    ) -> None:
        super().__init__()
        if rotary_emb.head_size != qk_rope_head_dim or rotary_emb.rotary_dim != qk_rope_head_dim:
            raise ValueError(f"MLA's rotary embedding must rotate all {qk_rope_head_dim} rope dims, got "
                             f"head_size={rotary_emb.head_size}, rotary_dim={rotary_emb.rotary_dim}")
        self.rotary_emb = rotary_emb
        self.rope_interleaved = rope_interleaved
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

    def rope(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, H, N + R], not rotated; last dim contiguous
        k_pe: torch.Tensor,  # [T, R], not rotated; last dim contiguous (any row stride)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # q_pe [T, H, R], k_pe [T, R]: rotated, contiguous
        """De-interleave (when the checkpoint's rope dims are) and rotate q's rope part and k_pe."""
        op = self.bound_ops.get("mla_rope")
        if op is not None:
            rot = self.rotary_emb
            return op(positions, q, k_pe, rot.cos_cache, rot.sin_cache, self.qk_nope_head_dim,
                      self.rope_interleaved)
        t, h, r = q.shape[0], self.num_heads, self.qk_rope_head_dim
        q_pe = q[..., self.qk_nope_head_dim :]
        if self.rope_interleaved:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = self.rotary_emb(positions, q_pe.reshape(t, h * r), k_pe.contiguous())
        return q_pe.view(t, h, r), k_pe

    def rope_norm(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, H, N + R], not rotated
        k_pe: torch.Tensor,  # [T, R], not rotated
        kv_c: torch.Tensor,  # [T, L]: raw when `kv_norm` is given
        kv_norm: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q_pe [T, H, R], k_pe [T, R], kv_c [T, L]
        """`rope` and `kv_norm(kv_c)`: one `mla_rope_norm` launch where that op is bound and the norm is a plain
        RMSNorm in kv_c's dtype (at batch 1 each launch in this chain is a few microseconds the step waits on)."""
        op = self.bound_ops.get("mla_rope_norm")
        if (op is not None and isinstance(kv_norm, RMSNorm) and kv_norm.fused_input_quant is None
                and kv_norm.weight.dtype == kv_c.dtype):
            rot = self.rotary_emb
            return op(positions, q, k_pe, kv_c, kv_norm.weight, kv_norm.variance_epsilon, rot.cos_cache,
                      rot.sin_cache, self.qk_nope_head_dim, self.rope_interleaved)
        if kv_norm is not None:
            kv_c = kv_norm(kv_c)
        q_pe, k_pe = self.rope(positions, q, k_pe)
        return q_pe, k_pe, kv_c

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        q: torch.Tensor,  # [num_tokens, H * (N + R)]: the q projection's output, rope part not rotated
        kv_c: torch.Tensor,  # [num_tokens, L], normalized -- or raw, with `kv_norm` given
        k_pe: torch.Tensor,  # [num_tokens, R], not rotated (may be a strided view)
        ctx: ForwardContext,
        kv_norm: Callable[[torch.Tensor], torch.Tensor] | None = None,  # kv_a_layernorm, applied here
    ) -> torch.Tensor:  # [num_tokens, H * V]
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope = q[..., : self.qk_nope_head_dim]
        # Inside a graph capture an impl that offers `fold_query` folds q_nope through W_UK on a side stream,
        # beside the latent's norm and the rope (keel.layers.side_stream): at batch 1 each is a few microseconds
        # of a chain the step waits on. Otherwise the impl folds the query itself.
        fold = getattr(self.impl, "fold_query", None)
        side = side_stream.fork(q) if fold is not None else None
        q_c = None
        if side is not None:
            with side_stream.on(side):
                q_c = fold(q_nope)
        q_pe, k_pe, kv_c = self.rope_norm(positions, q, k_pe, kv_c, kv_norm)
        side_stream.join(side)
        args = (q_nope, q_pe, kv_c, k_pe, ctx.kv_caches[self.layer_idx], ctx.attn_metadata[self.layer_idx])
        out = self.impl.forward(*args) if q_c is None else self.impl.forward(*args, q_c=q_c)
        return out.reshape(n, self.num_heads * self.v_head_dim)
