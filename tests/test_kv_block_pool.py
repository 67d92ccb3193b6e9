"""Block pool: free queue, null block, reference counts, LRU eviction, usage."""

from __future__ import annotations

import pytest

from keel.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue
from keel.kv_cache.blocks import KVCacheBlock, KVCacheBlocks
from keel.kv_cache.utils import KVCacheConfigError


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_remove_from_middle_and_append() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert len(q) == 5
    q.remove(blocks[2])
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4]
    q.append(blocks[2])
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4, 2]
    assert q.popleft() is blocks[0]
    assert ids(q.popleft_n(2)) == [1, 3]
    assert len(q) == 2
    with pytest.raises(RuntimeError):
        q.remove(blocks[0])  # not in the queue any more
    with pytest.raises(RuntimeError):
        q.append(blocks[4])  # already in it
    with pytest.raises(RuntimeError):
        q.popleft_n(3)


def test_null_block_reserved_and_never_handed_out() -> None:
    pool = BlockPool(num_blocks=4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 3
    got = pool.get_new_blocks(3)
    assert 0 not in ids(got)
    assert all(b.ref_cnt == 1 for b in got)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    # Freeing or touching the null block is a no-op: it is padding, not a resource.
    pool.free_blocks([pool.null_block])
    pool.touch([pool.null_block])
    assert pool.null_block.ref_cnt == 0 and pool.get_num_free_blocks() == 0


def test_too_few_blocks_is_a_typed_error() -> None:
    with pytest.raises(KVCacheConfigError, match="at least 2 blocks"):
        BlockPool(num_blocks=1)


def test_ref_counts_touch_and_free() -> None:
    pool = BlockPool(num_blocks=5)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])  # a second request shares a
    assert a.ref_cnt == 2
    pool.free_blocks([a, b])
    assert a.ref_cnt == 1 and b.ref_cnt == 0
    assert b in pool.free_block_queue.get_all_free_blocks()
    assert a not in pool.free_block_queue.get_all_free_blocks()
    pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([a])
    # Touching a free block pulls it out of the free queue.
    pool.touch([b])
    assert b.ref_cnt == 1 and b not in pool.free_block_queue.get_all_free_blocks()


def test_lru_order_and_eviction_of_cached_blocks() -> None:
    pool = BlockPool(num_blocks=6)
    blocks = pool.get_new_blocks(5)  # ids 1..5
    for i, blk in enumerate(blocks):
        blk.block_hash = bytes([i])  # as if cached
        pool.cached_block_hash_to_block[(blk.block_hash, 0)] = blk
    # A request frees its blocks tail first: its last block is the first to be evicted.
    pool.free_blocks(reversed(blocks[:3]))
    pool.free_blocks(reversed(blocks[3:]))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 2, 1, 5, 4]
    popped = pool.get_new_blocks(2)
    assert ids(popped) == [3, 2]
    # Popping evicts their hashes from the prefix cache; the others are still hits.
    assert all(b.block_hash is None for b in popped)
    assert pool.get_cached_block(bytes([2]), [0]) is None
    assert pool.get_cached_block(bytes([0]), [0]) == [blocks[0]]
    assert pool.get_cached_block(bytes([0]), [1]) is None  # other group


def test_usage_excludes_null_block() -> None:
    pool = BlockPool(num_blocks=5)
    assert pool.usage == 0.0
    got = pool.get_new_blocks(2)
    assert pool.usage == pytest.approx(0.5)
    pool.get_new_blocks(2)
    assert pool.usage == pytest.approx(1.0)
    pool.free_blocks(got)
    assert pool.usage == pytest.approx(0.5)


def test_pool_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(num_blocks=4)
    (blk,) = pool.get_new_blocks(1)
    blk.block_hash = b"h"
    pool.cached_block_hash_to_block[(b"h", 0)] = blk
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"h", [0]) == [blk]
    pool.free_blocks([blk])
    assert pool.reset_prefix_cache() is True
    assert blk.block_hash is None and not pool.cached_block_hash_to_block


def test_kv_cache_blocks_result_object() -> None:
    a, b = KVCacheBlock(3), KVCacheBlock(7)
    both = KVCacheBlocks([a]) + KVCacheBlocks([b])
    assert both.get_block_ids() == [3, 7]
    assert len(both) == 2 and both and not KVCacheBlocks()
    assert "id=3" in repr(a)
