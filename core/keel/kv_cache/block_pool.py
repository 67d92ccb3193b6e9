"""The block pool: every physical KV cache block, their reference counts, the LRU free queue and the
prefix-cache map from block hash to cached block.

The pool is shared by all KV cache groups (a block id names the same slot range in every layer of the
group that holds it); the prefix-cache key therefore carries the group id.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from keel.kv_cache.blocks import KVCacheBlock
from keel.kv_cache.hashing import BlockHash, BlockHashWithGroupId
from keel.kv_cache.utils import KVCacheConfigError, KVCacheRequest


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: head = least recently freed (evicted first), tail = most recent.

    A doubly linked list threaded through the blocks themselves, so removing a block from the middle
    (a prefix-cache hit on a free block) is O(1). Two sentinel blocks (ids -1) spare the edge cases.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        chain = [self._head, *blocks, self._tail]
        for prev, nxt in itertools.pairwise(chain):
            prev.next_free_block = nxt
            nxt.prev_free_block = prev

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is None or block is self._tail:
            raise RuntimeError("no free KV cache block to pop")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} free KV cache blocks, only {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None  # the head sentinel at least
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head-to-tail snapshot; O(n), for tests and debugging."""
        out = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """Owns all `num_blocks` blocks. Block 0 is the null block, never handed out.

    Called only by the per-kind managers (single_type.py) and the KV cache manager, from the scheduler
    thread; not thread-safe. Guarantees: a block is in the free queue iff its `ref_cnt` is 0 (the null
    block is never in it); a block popped for allocation has no hash (it was evicted from the prefix
    cache) and `ref_cnt == 1`.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise KVCacheConfigError(
                f"the KV cache needs at least 2 blocks (1 null block + 1 usable), got {num_blocks}; "
                "give the engine more KV cache memory or a smaller block size"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # One block per key: when two requests fill identical blocks concurrently, only the first is
        # registered; the second simply stays uncached and is reused as an ordinary free block.
        self.cached_block_hash_to_block: dict[BlockHashWithGroupId, KVCacheBlock] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_cached_block(self, block_hash: BlockHash, group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """The cached block for `block_hash` in each of `group_ids`, or None unless all groups hit."""
        out = []
        for gid in group_ids:
            block = self.cached_block_hash_to_block.get((block_hash, gid))
            if block is None:
                return None
            out.append(block)
        return out

    def cache_full_blocks(
        self,
        request: KVCacheRequest,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int,
    ) -> None:
        """Register `blocks[num_cached_blocks:num_full_blocks]` in the prefix cache.

        Called by a per-kind manager after allocation; `request.block_hashes` must already cover
        `num_full_blocks` blocks. Null blocks (sliding-window padding) are skipped.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        hashes = request.block_hashes
        if len(hashes) < num_full_blocks:
            raise RuntimeError(
                f"request {request.request_id} has {len(hashes)} block hashes, {num_full_blocks} needed"
            )
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null or block.block_hash is not None:
                continue
            key = (hashes[i], group_id)
            if key in self.cached_block_hash_to_block:
                continue
            block.block_hash = hashes[i]
            block.group_id = group_id
            self.cached_block_hash_to_block[key] = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks from the head of the free queue (evicting their cached hashes)."""
        if num_blocks > self.get_num_free_blocks():
            raise RuntimeError(f"cannot get {num_blocks} free blocks, only {self.get_num_free_blocks()} free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._maybe_evict_cached_block(block)
            if block.ref_cnt != 0:
                raise RuntimeError(f"{block} was in the free queue with a nonzero ref count")
            block.ref_cnt = 1
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        key = block.cache_key
        if key is None:
            return False
        if self.cached_block_hash_to_block.get(key) is block:
            del self.cached_block_hash_to_block[key]
        block.reset_hash()
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free hit leaves the free queue (so it is not evicted)."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue's tail in this order.

        Callers pass a request's blocks in reverse, so its last blocks are evicted first (the prefix,
        more likely shared, survives longest). Cached hashes are kept: a free block stays a cache hit.
        """
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (returns False) while any block is in use."""
        num_used = self.num_blocks - 1 - self.get_num_free_blocks()
        if num_used > 0:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (all but the null block) held by requests, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)
