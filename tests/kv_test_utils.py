"""Helpers shared by the KV cache tests (imported by name; tests/conftest.py puts this directory on sys.path)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Req:
    """The smallest object satisfying `keel.kv_cache.utils.KVCacheRequest`, for driving the manager directly."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    block_hashes: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)
