"""KVCacheManager: the scheduler's only handle on the paged KV cache.

Owns the block pool and one per-kind manager (single_type.py) for the KV cache group. Today there is a
single group (all attention layers share one spec); several groups would add a coordinator between
this class and the per-kind managers (intersecting prefix hits across groups, summing block demand)
without changing any method the scheduler calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from keel.kv_cache.block_pool import BlockPool
from keel.kv_cache.blocks import KVCacheBlocks
from keel.kv_cache.hashing import update_block_hashes
from keel.kv_cache.single_type import SingleTypeKVCacheManager, spec_manager_map
from keel.kv_cache.spec import KVCacheSpec
from keel.kv_cache.utils import KVCacheConfigError, KVCacheRequest


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups over one stats interval, in tokens (`requests` counts lookups)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    reset: bool = False  # the prefix cache was reset during the interval

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


# What a decode step that needs no new block gets (shared: KVCacheBlocks from the manager are read-only).
_NO_NEW_BLOCKS = KVCacheBlocks([])


class KVCacheManager:
    """Allocates KV cache blocks to requests and serves prefix-cache hits.

    Called by the scheduler, on its thread, in this pattern:
    - a WAITING request: `get_computed_blocks(req)` then, immediately (no other allocation between, or
      the hits could be evicted), `allocate_slots(req, n, num_new_computed_tokens, new_computed_blocks)`;
    - a RUNNING request each step: `allocate_slots(req, n, num_lookahead_tokens=k)`;
    - the KVCacheBlocks returned are read-only (the empty result of most decode steps is shared);
    - `None` from `allocate_slots` means "not enough free blocks": nothing changed, and the scheduler
      preempts someone (`free`) and retries, or leaves the request waiting;
    - `free(req)` when the request finishes, is aborted or is preempted.
    Guarantees: only full blocks of committed tokens are ever cached; the null block (id 0) is never
    handed out; a request's block ids only change at the end (new blocks appended) or, for sliding
    window, by earlier entries turning into the null block.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        enable_caching: bool = True,
        manager_classes: Mapping[str, type[SingleTypeKVCacheManager]] | None = None,
    ) -> None:
        classes = spec_manager_map if manager_classes is None else manager_classes
        manager_cls = classes.get(spec.kind)
        if manager_cls is None:
            raise KVCacheConfigError(
                f"no KV cache manager for spec kind {spec.kind!r} ({type(spec).__name__}); known kinds: "
                f"{sorted(classes)}. Register a manager for it under the 'kv_cache_spec' plugin kind."
            )
        self.spec = spec
        self.block_size = spec.block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.single_type_manager = manager_cls(spec, self.block_pool, kv_cache_group_id=0)
        self.prefix_cache_stats = PrefixCacheStats()
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1] (cached-but-free blocks count as free)."""
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @staticmethod
    def create_empty_block_list() -> KVCacheBlocks:
        return KVCacheBlocks([])

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[KVCacheBlocks, int]:
        """Prefix-cache lookup for a waiting request holding no blocks: (hit blocks, hit tokens).

        The hit is the longest run of cached full blocks matching the request's committed tokens,
        capped at `num_tokens - 1` tokens so the last token is always computed (its logits are needed).
        Takes no reference: pass the result to `allocate_slots` right away.
        """
        if not self.enable_caching:
            return self.create_empty_block_list(), 0
        block_hashes = update_block_hashes(request, self.block_size)
        max_hit_tokens = max(request.num_tokens - 1, 0)
        hits = self.single_type_manager.find_longest_cache_hit(block_hashes, max_hit_tokens)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens
        self.prefix_cache_queries_total += request.num_tokens
        self.prefix_cache_hits_total += num_hit_tokens
        return KVCacheBlocks(hits), num_hit_tokens

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for the request's next tokens; return the newly allocated blocks, or None.

        Slots cover `num_computed_tokens + num_new_computed_tokens + num_new_tokens +
        num_lookahead_tokens` tokens. `num_new_tokens` may include speculative draft tokens and
        lookahead tokens get slots, but only tokens that are both committed (< `request.num_tokens`)
        and computed by the end of this step are cached. All-or-nothing: None leaves every block,
        reference count and the free queue exactly as they were.
        """
        mgr = self.single_type_manager
        if (not num_new_computed_tokens and mgr.keeps_all_blocks and num_new_tokens >= 0 and num_lookahead_tokens >= 0
                and (new_computed_blocks is None or not new_computed_blocks.blocks)):
            # The common decode step: the last block still has room and no block fills up, so nothing
            # is allocated, hashed or cached. O(1), and exactly what the general path would do.
            rid = request.request_id
            held = mgr.req_to_blocks.get(rid)
            num_computed, bs = request.num_computed_tokens + num_new_tokens, self.block_size
            if held and num_computed + num_lookahead_tokens <= len(held) * bs:
                if not self.enable_caching:
                    return _NO_NEW_BLOCKS
                # Nothing to hash or cache: every full block of the committed tokens is hashed, and no
                # block fills up with committed, computed tokens in this step.
                num_tokens = request.num_tokens
                if (num_tokens // bs <= len(request.block_hashes)
                        and min(num_computed, num_tokens) // bs <= mgr.num_cached_block.get(rid, 0)):
                    return _NO_NEW_BLOCKS
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0, got num_new_tokens={num_new_tokens}, "
                f"num_new_computed_tokens={num_new_computed_tokens}, num_lookahead_tokens={num_lookahead_tokens}"
            )
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else []
        if len(hits) * self.block_size > num_new_computed_tokens:
            raise ValueError(
                f"{len(hits)} new computed blocks of {self.block_size} tokens but only "
                f"num_new_computed_tokens={num_new_computed_tokens}; pass what get_computed_blocks returned"
            )
        if hits and not self.enable_caching:
            raise ValueError("new_computed_blocks given but prefix caching is disabled")
        rid = request.request_id
        if hits and mgr.req_to_blocks.get(rid):
            raise ValueError(
                f"request {rid} already holds blocks; new_computed_blocks apply only to a request holding "
                "none (waiting, or preempted and freed)"
            )
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots = num_computed + num_new_tokens + num_lookahead_tokens
        num_needed = mgr.get_num_blocks_to_allocate(rid, num_slots, hits)
        # Blocks that fell out of a sliding window are released first, so they count as available.
        num_available = self.block_pool.get_num_free_blocks() + mgr.get_num_skipped_blocks_freed(
            rid, request.num_computed_tokens
        )
        if num_needed > num_available:
            return None

        mgr.remove_skipped_blocks(rid, request.num_computed_tokens)
        self.block_pool.touch(hits)
        mgr.save_new_computed_blocks(rid, hits)
        new_blocks = mgr.allocate_new_blocks(rid, num_slots)

        if self.enable_caching:
            # Drafts and lookahead tokens may be rejected: never cache past the committed tokens.
            num_to_cache = min(num_computed + num_new_tokens, request.num_tokens)
            update_block_hashes(request, self.block_size)
            mgr.cache_blocks(request, num_to_cache)
        return KVCacheBlocks(new_blocks)

    def free(self, request: KVCacheRequest) -> None:
        """Release every block of the request (no-op if it holds none). Cached blocks stay hits."""
        self.single_type_manager.free(request.request_id)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (null block entries are 0)."""
        return self.single_type_manager.get_block_ids(request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(list(self.single_type_manager.req_to_blocks.get(request_id, ())))

    def reset_prefix_cache(self) -> bool:
        """Drop all cached hashes; refused (False) while any request holds blocks."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats.reset = True
        return True

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Stats since the previous call; starts a new interval. Totals stay in `*_total` attributes."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats
