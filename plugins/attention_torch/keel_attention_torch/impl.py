"""The per-layer forward of torch_paged: scatter new K/V into the paged cache, then attend from it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from keel.attention.backend import AttentionLayerConfig
from keel_attention_torch.cache_ops import read_cache, store_slots
from keel_attention_torch.metadata import AttentionPlan, TorchPagedAttentionMetadata


class TorchPagedAttentionImpl:
    """Created by `TorchPagedAttentionBackend.get_impl(layer)` once per attention layer.

    `forward` is called by the layer every step. Pure-decode requests are attended as one padded
    batch (one gather, one SDPA call); requests with several new tokens (prefill, chunked prefill)
    share one gather and get one SDPA call each with an explicit causal/window mask. Softmax runs in
    float32 (SDPA's CPU kernel accumulates in float32 for fp16/bf16).
    """

    def __init__(self, layer: AttentionLayerConfig) -> None:
        self.layer = layer
        self.num_heads = layer.num_heads
        self.num_kv_heads = layer.num_kv_heads
        self.head_size = layer.head_size
        self.scale = layer.scale
        self.sliding_window = layer.sliding_window
        self.num_queries_per_kv = layer.num_heads // layer.num_kv_heads
        self.k_scale: torch.Tensor | None = None  # fp8 caches: the layer's scales (keel.layers.kv_scales)
        self.v_scale: torch.Tensor | None = None

    def set_kv_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Called once by the attention layer when its cache is fp8 (float32 [1] each)."""
        self.k_scale, self.v_scale = k_scale, v_scale

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_size]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: TorchPagedAttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_size)  # [num_slots, kv_heads, head]
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_size)
        self._write(k, v, key_cache, value_cache, metadata)

        plan = metadata.plan(self.sliding_window)
        num_rows = q.shape[0]
        dec = plan.decode
        if dec is not None and dec.num_reqs == num_rows and not plan.prefill:
            return self._decode(q, key_cache, value_cache, metadata)

        out = torch.empty_like(q)
        if metadata.num_tokens < num_rows:
            out[metadata.num_tokens :].zero_()  # padding rows: unspecified, but never garbage
        if dec is not None:
            dec_out = self._decode(q, key_cache, value_cache, metadata)
            if isinstance(dec.rows, slice):
                out[dec.rows] = dec_out
            else:
                out.index_copy_(0, dec.rows, dec_out)
        if plan.prefill:
            self._prefill(q, key_cache, value_cache, plan, out)
        return out

    def _write(
        self,
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        key_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_size]
        value_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_size]
        md: TorchPagedAttentionMetadata,
    ) -> None:
        slots = md.write_slots
        if md.write_rows is None:
            n = slots.shape[0]
            k, v = k[:n], v[:n]
        else:
            k, v = k.index_select(0, md.write_rows), v.index_select(0, md.write_rows)
        store_slots(key_cache, slots, k, self.k_scale)
        store_slots(value_cache, slots, v, self.v_scale)

    def _decode(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_size]
        value_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_size]
        md: TorchPagedAttentionMetadata,
    ) -> torch.Tensor:  # [num_decode_reqs, num_heads, head_size]
        dec = md.plan(self.sliding_window).decode
        assert dec is not None  # internal: callers check
        b, hkv, d = dec.num_reqs, self.num_kv_heads, self.head_size
        qd = q[dec.rows] if isinstance(dec.rows, slice) else q.index_select(0, dec.rows)
        # GQA without repeating K/V: query heads of one KV head form the "sequence" axis of length G.
        qd = qd.view(b, hkv, self.num_queries_per_kv, d)
        keys = key_cache.index_select(0, dec.slots).view(b, dec.key_len, hkv, d).transpose(1, 2)
        values = value_cache.index_select(0, dec.slots).view(b, dec.key_len, hkv, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qd, read_cache(keys, self.k_scale, qd.dtype), read_cache(values, self.v_scale, qd.dtype),
            attn_mask=dec.mask, scale=self.scale
        )  # [B, kv_heads, G, head_size]
        return out.reshape(b, self.num_heads, d)

    def _prefill(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_size]
        value_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_size]
        plan: AttentionPlan,
        out: torch.Tensor,  # [num_tokens, num_heads, head_size], filled in place
    ) -> None:
        # [sum key_len, kv_heads, head]
        keys = read_cache(key_cache.index_select(0, plan.prefill_slots), self.k_scale, q.dtype)
        values = read_cache(value_cache.index_select(0, plan.prefill_slots), self.v_scale, q.dtype)
        gqa = self.num_queries_per_kv > 1
        # 4-D inputs: with 3-D ones SDPA on the CPU skips its flash kernel and materializes the scores.
        for seq in plan.prefill:
            qs = q[seq.token_start : seq.token_end].transpose(0, 1)[None]  # [1, heads, query_len, head]
            ks = keys[seq.key_start : seq.key_end].transpose(0, 1)[None]  # [1, kv_heads, key_len, head]
            vs = values[seq.key_start : seq.key_end].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=seq.mask, is_causal=seq.mask is None, scale=self.scale, enable_gqa=gqa
            )  # [1, heads, query_len, head]
            out[seq.token_start : seq.token_end] = o[0].transpose(0, 1)
