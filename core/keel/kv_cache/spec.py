"""KVCacheSpec: a frozen description of one attention layer's per-token state.

The model runner asks each attention layer for its spec; layers with equal specs share one KV cache
group. The spec's `kind` is a registry key (`kv_cache_spec` kind) naming the manager logic that
allocates blocks for it, so a new kind (say a state-space layer) is registered, not added to a switch
in the core.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVCacheSpec:
    """Base spec. `block_size` tokens per block; `page_size_bytes` is one block of one layer."""

    block_size: int
    dtype: torch.dtype

    kind = "base"

    @property
    def page_size_bytes(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def max_blocks_needed(self, num_tokens: int) -> int:
        """Blocks a request of `num_tokens` tokens holds at most (whole context for full attention)."""
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Separate K and V per token per KV head: cache tensor [2, num_blocks, block_size, kv_heads, head]."""

    num_kv_heads: int = 1
    head_size: int = 1

    kind = "full_attention"

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * dtype_size(self.dtype)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Like full attention, but tokens older than `sliding_window` are never read again.

    The manager may free blocks that fell entirely out of the window.
    """

    sliding_window: int = 0

    kind = "sliding_window"

    def max_blocks_needed(self, num_tokens: int) -> int:
        return min(-(-num_tokens // self.block_size), -(-self.sliding_window // self.block_size) + 1)


@dataclass(frozen=True)
class MLALatentSpec(KVCacheSpec):
    """Multi-head latent attention: one latent vector per token (kv_lora_rank + rope dims), no heads.

    Cache tensor [num_blocks, block_size, latent_size]; K/V are never materialized in the cache.
    """

    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    kind = "mla_latent"

    @property
    def latent_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.latent_size * dtype_size(self.dtype)
