"""Sliding-window manager: out-of-window blocks are released; prefix hits respect the window."""

from __future__ import annotations

import pytest
import torch
from kv_test_utils import Req

from keel.kv_cache.block_pool import BlockPool
from keel.kv_cache.hashing import update_block_hashes
from keel.kv_cache.manager import KVCacheManager
from keel.kv_cache.single_type import FullAttentionManager, SlidingWindowManager
from keel.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec

BS = 4


def make(window: int, num_blocks: int = 11) -> KVCacheManager:
    return KVCacheManager(SlidingWindowSpec(BS, torch.float16, 2, 8, window), num_blocks)


def prefill(m: KVCacheManager, r: Req) -> None:
    hits, n_hit = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - n_hit, n_hit, hits) is not None
    r.num_computed_tokens = r.num_tokens


def decode(m: KVCacheManager, r: Req, token: int) -> bool:
    r.all_token_ids.append(token)
    if m.allocate_slots(r, 1) is None:
        return False
    r.num_computed_tokens += 1
    return True


def test_out_of_window_blocks_are_freed_but_stay_cached() -> None:
    m = make(window=8)
    r = Req("a", list(range(20)))
    prefill(m, r)
    assert m.get_block_ids("a") == [1, 2, 3, 4, 5]
    assert decode(m, r, 20)
    # The token at position 20 reads positions 13..20: blocks 0-2 (tokens 0..11) are never read again.
    assert m.get_block_ids("a") == [0, 0, 0, 4, 5, 6]
    blocks = m.block_pool.blocks
    assert [blocks[i].ref_cnt for i in (1, 2, 3)] == [0, 0, 0]
    assert all(blocks[i].block_hash is not None for i in (1, 2, 3))
    assert m.usage == pytest.approx(3 / 10)
    # A request with the same prefix hits: only the window's blocks are real, the rest is null padding.
    other = Req("b", list(range(21)))
    hits, n_hit = m.get_computed_blocks(other)
    assert n_hit == 20 and hits.get_block_ids() == [0, 0, 0, 4, 5]
    assert m.allocate_slots(other, 1, n_hit, hits) is not None
    assert blocks[4].ref_cnt == 2 and blocks[1].ref_cnt == 0
    m.free(r)
    m.free(other)
    assert m.num_free_blocks == 10 and m.usage == 0.0


def test_window_boundary_block_is_kept() -> None:
    m = make(window=8)
    r = Req("a", list(range(18)))
    prefill(m, r)
    assert decode(m, r, 18)
    # Position 18 reads 11..18: block 2 (tokens 8..11) is still needed by one token.
    assert m.get_block_ids("a") == [0, 0, 3, 4, 5]
    assert decode(m, r, 19)
    assert m.get_block_ids("a") == [0, 0, 0, 4, 5]  # position 19 reads 12..19


def _cache_pattern(pattern: list[bool], window: int) -> tuple[BlockPool, list, list]:
    pool = BlockPool(num_blocks=len(pattern) + 1)
    r = Req("x", list(range(len(pattern) * BS + 1)))
    hashes = update_block_hashes(r, BS)
    blocks = pool.get_new_blocks(len(pattern))
    pool.cache_full_blocks(r, blocks, 0, len(pattern), group_id=0)
    for blk, cached in zip(blocks, pattern, strict=True):
        if not cached:
            pool._maybe_evict_cached_block(blk)
    return pool, hashes, blocks


def test_hit_is_longest_prefix_with_a_cached_window() -> None:
    # window 8 -> the first computed token needs the 2 blocks before it.
    pool, hashes, blocks = _cache_pattern([True, False, True, True, False, True], window=8)
    spec = SlidingWindowSpec(BS, torch.float16, 2, 8, 8)
    sw = SlidingWindowManager(spec, pool)
    hits = sw.find_longest_cache_hit(hashes, max_length=6 * BS)
    assert hits == [pool.null_block, pool.null_block, blocks[2], blocks[3]]
    # Full attention needs every block: only block 0 is usable there.
    full = FullAttentionManager(FullAttentionSpec(BS, torch.float16, 2, 8), pool)
    assert full.find_longest_cache_hit(hashes, 6 * BS) == [blocks[0]]
    # The cap on hit tokens applies before the window search.
    assert sw.find_longest_cache_hit(hashes, max_length=3 * BS + 3) == [blocks[0]]


def test_short_run_from_the_start_is_still_a_hit() -> None:
    pool, hashes, blocks = _cache_pattern([True, False, True, False], window=8)
    sw = SlidingWindowManager(SlidingWindowSpec(BS, torch.float16, 2, 8, 8), pool)
    assert sw.find_longest_cache_hit(hashes, 4 * BS) == [blocks[0]]
    pool2, hashes2, _ = _cache_pattern([False, True, False, False], window=8)
    sw2 = SlidingWindowManager(SlidingWindowSpec(BS, torch.float16, 2, 8, 8), pool2)
    assert sw2.find_longest_cache_hit(hashes2, 4 * BS) == []


def test_released_blocks_count_as_available() -> None:
    m = make(window=4, num_blocks=4)  # 3 usable
    r = Req("a", list(range(12)))
    prefill(m, r)
    assert m.num_free_blocks == 0
    # Position 12 reads 9..12: blocks 0, 1 go back to the pool and one is reused for the new block.
    assert decode(m, r, 12)
    assert m.get_block_ids("a") == [0, 0, 3, 2]
    assert m.num_free_blocks == 1


def test_failed_allocation_does_not_release_shared_blocks() -> None:
    m = make(window=4, num_blocks=4)
    a = Req("a", list(range(8)))
    prefill(m, a)
    b = Req("b", list(range(8)))
    prefill(m, b)  # hits a's first block (shared), allocates one
    assert m.get_block_ids("b") == [1, 3] and m.block_pool.blocks[1].ref_cnt == 2
    # a's first block leaves its window, but b still holds it: nothing is freed, so no room.
    assert not decode(m, a, 8)
    assert m.get_block_ids("a") == [1, 2] and m.block_pool.blocks[1].ref_cnt == 2


def test_sliding_window_manager_needs_a_window_spec() -> None:
    with pytest.raises(TypeError, match="SlidingWindowSpec"):
        SlidingWindowManager(FullAttentionSpec(BS, torch.float16), BlockPool(4))
