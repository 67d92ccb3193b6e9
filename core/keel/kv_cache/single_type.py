"""Per-spec-kind block bookkeeping for one KV cache group: which blocks each request holds.

`KVCacheManager` owns one of these per KV cache group and picks the class by the group's `spec.kind`
(registered under the `kv_cache_spec` registry kind, default mapping `spec_manager_map`). The
subclasses differ in what "a prefix-cache hit" and "blocks no longer needed" mean for their layers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from keel.kv_cache.block_pool import BlockPool
from keel.kv_cache.blocks import KVCacheBlock
from keel.kv_cache.hashing import BlockHash
from keel.kv_cache.spec import KVCacheSpec, SlidingWindowSpec
from keel.kv_cache.utils import KVCacheRequest, cdiv


class SingleTypeKVCacheManager:
    """Block tables of one KV cache group. Base behaviour is full attention: every block is kept.

    Called only by `KVCacheManager`, in this order within one `allocate_slots`:
    `get_num_blocks_to_allocate` / `get_num_skipped_blocks_freed` (pure checks), then
    `remove_skipped_blocks`, `save_new_computed_blocks`, `allocate_new_blocks`, `cache_blocks`.
    `find_longest_cache_hit` is called from `get_computed_blocks`; `free` when a request finishes or
    is preempted.
    """

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int = 0) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        # Full-attention bookkeeping as defined here (no block ever skipped): lets
        # `KVCacheManager.allocate_slots` return at once on a step that needs no new block.
        base = SingleTypeKVCacheManager
        self.keeps_all_blocks = all(
            getattr(type(self), name) is getattr(base, name)
            for name in ("get_num_blocks_to_allocate", "get_num_skipped_blocks_freed", "remove_skipped_blocks",
                         "save_new_computed_blocks", "allocate_new_blocks", "cache_blocks")
        )
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # Leading blocks of each request already registered in the prefix cache (or skipped as null).
        self.num_cached_block: dict[str, int] = {}

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free blocks this request would consume to hold `num_tokens` tokens (no state change).

        New computed blocks that are currently free count too: touching them takes them out of the
        free queue.
        """
        num_required = cdiv(num_tokens, self.block_size)
        num_new = num_required - len(new_computed_blocks) - len(self.req_to_blocks.get(request_id, ()))
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return max(num_new, 0) + num_evictable_hits

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """Append prefix-cache hits (already touched) to a request that holds no blocks yet."""
        if not new_computed_blocks:
            return
        blocks = self.req_to_blocks[request_id]
        if blocks:
            raise RuntimeError(
                f"request {request_id} already holds blocks; prefix-cache hits apply only to a request "
                "that holds none (a waiting or freshly preempted request)"
            )
        blocks.extend(new_computed_blocks)
        # Hits are cached blocks (or null padding) already: never register them again.
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's block table to hold `num_tokens` tokens; return the blocks added."""
        blocks = self.req_to_blocks[request_id]
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        """Register the request's full blocks among its first `num_tokens` (committed) tokens."""
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks[rid], num_cached, num_full, self.kv_cache_group_id
        )
        self.num_cached_block[rid] = num_full

    def free(self, request_id: str) -> None:
        """Release all the request's blocks, tail first (so its last blocks are evicted first)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """Cached blocks for the longest usable prefix of at most `max_length` tokens (full blocks)."""
        group_ids = (self.kv_cache_group_id,)
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            cached = self.block_pool.get_cached_block(block_hash, group_ids)
            if cached is None:
                break
            hits.append(cached[0])
        return hits

    def get_num_skipped_blocks_freed(self, request_id: str, num_computed_tokens: int) -> int:
        """How many blocks `remove_skipped_blocks` would return to the free queue (no state change)."""
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks no future token of the request will read. Full attention reads them all."""


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention (and MLA latents): the whole context stays; a hit is any cached prefix."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention: a token at position p reads positions [p - window + 1, p].

    Blocks entirely before the window of the next token to compute are replaced by the null block in
    the request's table and freed (their hashes stay cached until evicted). A prefix-cache hit only
    needs the blocks inside the window of the first token to compute; earlier entries are null.
    """

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int = 0) -> None:
        if not isinstance(spec, SlidingWindowSpec) or spec.sliding_window <= 0:
            raise TypeError(
                f"SlidingWindowManager needs a SlidingWindowSpec with sliding_window > 0, got {spec}"
            )
        super().__init__(spec, block_pool, kv_cache_group_id)
        self.sliding_window = spec.sliding_window

    def _num_skipped_blocks(self, num_computed_tokens: int) -> int:
        # The next token to compute sits at position num_computed_tokens; older than this is unread.
        first_needed_token = num_computed_tokens - self.sliding_window + 1
        return max(first_needed_token, 0) // self.block_size

    def _skippable(self, request_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.get(request_id, [])
        end = min(self._num_skipped_blocks(num_computed_tokens), len(blocks))
        return [b for b in blocks[:end] if not b.is_null]

    def get_num_skipped_blocks_freed(self, request_id: str, num_computed_tokens: int) -> int:
        return sum(1 for b in self._skippable(request_id, num_computed_tokens) if b.ref_cnt == 1)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        end = min(self._num_skipped_blocks(num_computed_tokens), len(blocks))
        removed = []
        # Newest first, as in `free`; stop at the first null: everything before it was removed earlier.
        for i in range(end - 1, -1, -1):
            if blocks[i].is_null:
                break
            removed.append(blocks[i])
            blocks[i] = self.block_pool.null_block
        self.block_pool.free_blocks(removed)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """The longest prefix whose last `cdiv(window - 1, block_size)` blocks are all cached.

        Searching right to left stops at the first long-enough run, which is the longest usable hit;
        if none is long enough, a run starting at block 0 is still a hit (the window reaches position 0).
        """
        # The first token to compute reads window - 1 earlier tokens, all within these trailing blocks.
        # At least one verified block: its chained hash proves the whole prefix was computed.
        needed = max(cdiv(self.sliding_window - 1, self.block_size), 1)
        group_ids = (self.kv_cache_group_id,)
        max_num_blocks = min(max_length // self.block_size, len(block_hashes))
        hits = [self.block_pool.null_block] * max_num_blocks
        run = 0
        for i in range(max_num_blocks - 1, -1, -1):
            cached = self.block_pool.get_cached_block(block_hashes[i], group_ids)
            if cached is None:
                run = 0
                continue
            hits[i] = cached[0]
            run += 1
            if run >= needed:
                return hits[: i + run]
        return hits[:run]


# Default kind -> manager class. The plugin registry maps the same kind strings to these classes.
spec_manager_map: dict[str, type[SingleTypeKVCacheManager]] = {
    "full_attention": FullAttentionManager,
    "sliding_window": SlidingWindowManager,
    "mla_latent": FullAttentionManager,
}
