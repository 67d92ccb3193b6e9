"""TorchMLABackend (`torch_mla`): reference multi-head latent attention over a latent paged cache.

Serves `MLAAttention` layers (DeepSeek-V2/V3) on any device in plain torch; the forward contract is
defined in `keel.layers.mla_attention`. The cache holds one latent cat(kv_c, k_pe) per token,
[num_blocks, block_size, kv_lora_rank + rope_dim]. Decode requests run absorbed (q folded through
W_UK, attention over latents as one shared head, W_UV after); prefill requests expand K/V from the
latents of their own context. Step metadata is torch_paged's (the same gather plans serve both).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from keel.attention.backend import (
    AttentionLayerConfig,
    BackendCapabilities,
    BackendRequest,
    default_validate,
    latent_kv_cache_shape,
    mla_layer_reasons,
)
from keel.kv_cache.spec import KVCacheSpec
from keel_attention_torch.backend import UnsupportedLayerError
from keel_attention_torch.cache_ops import read_cache, store_slots
from keel_attention_torch.metadata import TorchPagedAttentionMetadata, TorchPagedMetadataBuilder


class TorchMLABackend:
    """Registered under `attention_backend` as `torch_mla` by the `attention-torch` plugin."""

    name: ClassVar[str] = "torch_mla"
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        kv_cache_kinds=("mla_latent",),
        supports_mla=True,
        kv_cache_dtypes=(torch.float8_e4m3fn,),
    )

    @classmethod
    def validate(cls, request: BackendRequest) -> list[str]:
        """Called by the selector at startup: MLA layers only, with their dimensions in `extra`."""
        reasons = default_validate(cls.capabilities, request)
        layer = request.layer
        if not layer.use_mla:
            reasons.append("torch_mla serves only MLA layers (use_mla=True)")
            return reasons
        reasons += mla_layer_reasons(layer)
        return reasons

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, spec: KVCacheSpec) -> tuple[int, ...]:
        """Called by the runner per layer: (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)."""
        return latent_kv_cache_shape("torch_mla", num_blocks, spec)

    @classmethod
    def get_metadata_builder(cls, device: torch.device) -> TorchPagedMetadataBuilder:
        """Called by the runner once per KV cache group."""
        return TorchPagedMetadataBuilder(device)

    @classmethod
    def get_impl(cls, layer: AttentionLayerConfig) -> TorchMLAImpl:
        """Called once per MLA layer when the model is built."""
        reasons = cls.validate(BackendRequest(layer=layer, device_type="cpu", kv_cache_kind="mla_latent"))
        if reasons:
            raise UnsupportedLayerError(f"torch_mla cannot serve layer {layer}: " + "; ".join(reasons))
        return TorchMLAImpl(layer)


class TorchMLAImpl:
    """Created by `TorchMLABackend.get_impl`; satisfies `keel.layers.mla_attention.MLAAttentionImpl`."""

    def __init__(self, layer: AttentionLayerConfig) -> None:
        extra = dict(layer.extra)
        self.num_heads = layer.num_heads
        self.scale = layer.scale
        self.kv_lora_rank: int = extra["kv_lora_rank"]
        self.qk_nope_head_dim: int = extra["qk_nope_head_dim"]
        self.qk_rope_head_dim: int = extra["qk_rope_head_dim"]
        self.v_head_dim: int = extra["v_head_dim"]
        self.w_uk: torch.Tensor | None = None  # [H, N, L]
        self.w_uv: torch.Tensor | None = None  # [H, V, L]
        self.k_scale: torch.Tensor | None = None  # fp8 latent caches: the layer's scale (keel.layers.kv_scales)

    def set_kv_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Called once by the MLA layer when its latent cache is fp8; the latent uses `k_scale`."""
        self.k_scale = k_scale

    def process_weights_after_loading(
        self,
        w_uk: torch.Tensor,  # [H, N, L]
        w_uv: torch.Tensor,  # [H, V, L]
    ) -> None:
        self.w_uk, self.w_uv = w_uk, w_uv

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, N]
        q_pe: torch.Tensor,  # [T, H, R]
        kv_c: torch.Tensor,  # [T, L]
        k_pe: torch.Tensor,  # [T, R]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
        metadata: TorchPagedAttentionMetadata,
    ) -> torch.Tensor:  # [T, H, V]
        if self.w_uk is None or self.w_uv is None:
            raise RuntimeError(
                "torch_mla: process_weights_after_loading was never called; the model must hand over "
                "kv_b_proj's W_UK/W_UV after loading its weights"
            )
        q = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, N + R]: the reference's one query
        cache = kv_cache.view(-1, self.kv_lora_rank + self.qk_rope_head_dim)  # [num_slots, L + R]
        self._write(kv_c, k_pe, cache, metadata)
        plan = metadata.plan(None)
        num_rows = q.shape[0]
        dec = plan.decode
        out = q.new_empty(num_rows, self.num_heads, self.v_head_dim)
        if metadata.num_tokens < num_rows:
            out[metadata.num_tokens :].zero_()  # padding rows: unspecified, but never garbage
        if dec is not None:
            qd = q[dec.rows] if isinstance(dec.rows, slice) else q.index_select(0, dec.rows)
            dec_out = self._decode_absorbed(qd, cache, dec.slots, dec.key_len, dec.mask)
            if isinstance(dec.rows, slice):
                out[dec.rows] = dec_out
            else:
                out.index_copy_(0, dec.rows, dec_out)
        if plan.prefill:
            assert plan.prefill_slots is not None  # internal: set whenever prefill is non-empty
            latents = read_cache(cache.index_select(0, plan.prefill_slots), self.k_scale, q.dtype)  # [S, L + R]
            for seq in plan.prefill:
                out[seq.token_start : seq.token_end] = self._prefill_expanded(
                    q[seq.token_start : seq.token_end], latents[seq.key_start : seq.key_end], seq.mask
                )
        return out

    def _write(
        self,
        kv_c: torch.Tensor,  # [T, L]
        k_pe: torch.Tensor,  # [T, R]
        cache: torch.Tensor,  # [num_slots, L + R]
        md: TorchPagedAttentionMetadata,
    ) -> None:
        slots = md.write_slots
        latent = torch.cat((kv_c, k_pe), dim=-1)  # [T, L + R]
        latent = latent[: slots.shape[0]] if md.write_rows is None else latent.index_select(0, md.write_rows)
        store_slots(cache, slots, latent, self.k_scale)

    def _decode_absorbed(
        self,
        q: torch.Tensor,  # [B, H, N + R]
        cache: torch.Tensor,  # [num_slots, L + R]
        slots: torch.Tensor,  # [B * key_len] int64
        key_len: int,
        mask: torch.Tensor | None,  # [B, 1, 1, key_len] bool
    ) -> torch.Tensor:  # [B, H, V]
        b, n, lora = q.shape[0], self.qk_nope_head_dim, self.kv_lora_rank
        q_nope, q_pe = q[..., :n], q[..., n:]
        q_latent = torch.einsum("bhn,hnl->bhl", q_nope, self.w_uk)  # W_UK folded into the query
        q_cat = torch.cat((q_latent, q_pe), dim=-1)[:, None]  # [B, 1, H, L + R]: heads as the query axis
        latents = read_cache(cache.index_select(0, slots).view(b, 1, key_len, -1), self.k_scale, q.dtype)
        o = F.scaled_dot_product_attention(
            q_cat, latents, latents[..., :lora], attn_mask=mask, scale=self.scale
        )  # [B, 1, H, L]
        return torch.einsum("bhl,hvl->bhv", o[:, 0], self.w_uv)

    def _prefill_expanded(
        self,
        q: torch.Tensor,  # [Q, H, N + R]
        latents: torch.Tensor,  # [S, L + R], the request's context including the new tokens
        mask: torch.Tensor | None,  # [Q, S] bool, True = attend; None = square causal
    ) -> torch.Tensor:  # [Q, H, V]
        kv_c, k_pe = latents[:, : self.kv_lora_rank], latents[:, self.kv_lora_rank :]
        k_nope = torch.einsum("sl,hnl->hsn", kv_c, self.w_uk)  # [H, S, N]
        v = torch.einsum("sl,hvl->hsv", kv_c, self.w_uv)  # [H, S, V]
        k = torch.cat((k_nope, k_pe[None].expand(self.num_heads, -1, -1)), dim=-1)  # [H, S, N + R]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, is_causal=mask is None, scale=self.scale
        )  # [1, H, Q, V]
        return o[0].transpose(0, 1)
