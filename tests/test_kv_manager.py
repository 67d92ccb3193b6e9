"""KVCacheManager: allocation, prefix hits, salts, all-or-nothing, lookahead, stats (full attention)."""

from __future__ import annotations

import pytest
import torch
from kv_test_utils import Req

from keel.kv_cache.manager import KVCacheManager
from keel.kv_cache.single_type import FullAttentionManager
from keel.kv_cache.spec import FullAttentionSpec, KVCacheSpec, MLALatentSpec
from keel.kv_cache.utils import KVCacheConfigError, KVCacheRequest

BS = 4


def make(num_blocks: int = 11, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(FullAttentionSpec(BS, torch.float16, 2, 8), num_blocks, enable_caching=caching)


def schedule_prompt(m: KVCacheManager, r: Req, budget: int | None = None) -> list[int] | None:
    """What the scheduler does for a waiting request; returns the new block ids (None: no room)."""
    hits, n_hit = m.get_computed_blocks(r)
    n_new = r.num_tokens - n_hit if budget is None else min(budget, r.num_tokens - n_hit)
    new = m.allocate_slots(r, n_new, n_hit, hits)
    if new is None:
        return None
    r.num_computed_tokens = n_hit + n_new
    return new.get_block_ids()


def test_request_protocol_is_structural() -> None:
    assert isinstance(Req("a", [1]), KVCacheRequest)


def test_allocate_grow_and_free() -> None:
    m = make()
    r = Req("a", list(range(10)))
    assert schedule_prompt(m, r) == [1, 2, 3]
    assert m.get_block_ids("a") == [1, 2, 3]
    assert m.num_free_blocks == 7
    # Decode: one sampled token per step; a new block only when the last one is full.
    for step in range(3):
        r.all_token_ids.append(100 + step)
        new = m.allocate_slots(r, 1)
        assert new is not None
        r.num_computed_tokens += 1
        assert new.get_block_ids() == ([4] if step == 2 else [])
    assert all(b.ref_cnt == 1 for b in m.get_blocks("a").blocks)
    m.free(r)
    assert m.get_block_ids("a") == [] and m.num_free_blocks == 10 and m.usage == 0.0
    m.free(r)  # freeing twice (e.g. abort after finish) is harmless


def test_prefix_hit_across_requests_partial_block_not_shared() -> None:
    m = make()
    a = Req("a", list(range(10)))
    schedule_prompt(m, a)
    b = Req("b", list(range(10)) + [50, 51])
    hits, n_hit = m.get_computed_blocks(b)
    # 2 full blocks match; a's third block (tokens 8, 9) is partial, never cached.
    assert n_hit == 8 and hits.get_block_ids() == [1, 2]
    new = m.allocate_slots(b, b.num_tokens - n_hit, n_hit, hits)
    assert new is not None and new.get_block_ids() == [4]
    assert m.get_block_ids("b") == [1, 2, 4]
    blocks = m.block_pool.blocks
    assert blocks[1].ref_cnt == 2 and blocks[2].ref_cnt == 2 and blocks[3].ref_cnt == 1
    m.free(a)
    assert blocks[1].ref_cnt == 1 and blocks[3].ref_cnt == 0


def test_last_token_always_recomputed() -> None:
    m = make()
    a = Req("a", list(range(8)))  # exactly two full blocks
    schedule_prompt(m, a)
    m.free(a)
    b = Req("b", list(range(8)))
    hits, n_hit = m.get_computed_blocks(b)
    assert n_hit == 4 and hits.get_block_ids() == [1]  # not 8: the last token's logits are needed
    c = Req("c", list(range(9)))
    assert m.get_computed_blocks(c)[1] == 8


def test_hit_on_free_block_survives_and_counts_against_capacity() -> None:
    m = make(num_blocks=4)  # 3 usable
    a = Req("a", list(range(9)))
    schedule_prompt(m, a)
    m.free(a)
    assert m.num_free_blocks == 3
    b = Req("b", list(range(8)) + [99, 98, 97, 96, 95])  # hits 2 free cached blocks, needs 2 more
    hits, n_hit = m.get_computed_blocks(b)
    assert n_hit == 8
    # Two hits leave the free queue, so only one block remains for the two new ones: no room.
    assert m.allocate_slots(b, b.num_tokens - n_hit, n_hit, hits) is None
    assert m.num_free_blocks == 3 and all(blk.ref_cnt == 0 for blk in hits.blocks)
    new = m.allocate_slots(b, 4, n_hit, hits)
    assert new is not None and new.get_block_ids() == [3]
    assert m.get_block_ids("b") == [1, 2, 3]


def test_cache_salt_isolation() -> None:
    m = make()
    a = Req("a", list(range(12)), cache_salt="alice")
    schedule_prompt(m, a)
    assert m.get_computed_blocks(Req("b", list(range(12)), cache_salt="bob"))[1] == 0
    assert m.get_computed_blocks(Req("c", list(range(12))))[1] == 0
    assert m.get_computed_blocks(Req("d", list(range(12)), cache_salt="alice"))[1] == 8


def test_all_or_nothing_failure() -> None:
    m = make(num_blocks=6)  # 5 usable
    a = Req("a", list(range(12)))
    schedule_prompt(m, a)
    b = Req("b", list(range(100, 112)))
    before = (m.num_free_blocks, [x.ref_cnt for x in m.block_pool.blocks], m.get_block_ids("a"))
    assert schedule_prompt(m, b) is None
    after = (m.num_free_blocks, [x.ref_cnt for x in m.block_pool.blocks], m.get_block_ids("a"))
    assert before == after and m.get_block_ids("b") == []
    # With the same hits but a failing allocation, the hits are not touched either.
    c = Req("c", list(range(8)) + list(range(200, 216)))
    hits, n_hit = m.get_computed_blocks(c)
    assert n_hit == 8
    assert m.allocate_slots(c, c.num_tokens - n_hit, n_hit, hits) is None
    assert [blk.ref_cnt for blk in hits.blocks] == [1, 1]
    m.free(a)
    # Never-used blocks first, then a's blocks tail first (its prefix 1, 2 survives as a hit).
    assert schedule_prompt(m, b) == [4, 5, 3]


def test_lru_evicts_tail_of_sequence_first() -> None:
    m = make(num_blocks=7)  # 6 usable
    a = Req("a", list(range(13)))  # 4 blocks: 1..4, three cached
    schedule_prompt(m, a)
    m.free(a)
    # Free queue: untouched 5, 6, then a's blocks tail first 4, 3, 2, 1.
    assert [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()] == [5, 6, 4, 3, 2, 1]
    b = Req("b", list(range(500, 516)))  # 4 new blocks: takes 5, 6, 4, 3 -> evicts a's 3rd block
    schedule_prompt(m, b)
    assert m.get_block_ids("b") == [5, 6, 4, 3]
    c = Req("c", list(range(13)))
    hits, n_hit = m.get_computed_blocks(c)
    assert hits.get_block_ids() == [1, 2] and n_hit == 8  # the prefix survived, the tail was evicted


def test_lookahead_and_drafts_never_cached() -> None:
    m = make()
    r = Req("a", list(range(6)))
    schedule_prompt(m, r)
    r.all_token_ids.append(6)  # sampled token; 3 draft tokens proposed (not in all_token_ids)
    # 1 committed + 3 drafts as new tokens, 2 lookahead slots: slots for 6 + 4 + 2 = 12 tokens.
    new = m.allocate_slots(r, 4, num_lookahead_tokens=2)
    assert new is not None and len(m.get_block_ids("a")) == 3
    # Only the 7 committed tokens count: block 0 full (cached), block 1 has 3 committed -> not cached.
    assert len(r.block_hashes) == 1
    assert [m.block_pool.blocks[i].block_hash is not None for i in m.get_block_ids("a")] == [
        True,
        False,
        False,
    ]
    # Rollback: all drafts rejected; the scheduler lowers num_computed_tokens; blocks stay.
    r.num_computed_tokens = 7
    r.all_token_ids.append(7)
    assert m.allocate_slots(r, 1) is not None and len(m.get_block_ids("a")) == 3
    r.num_computed_tokens = 8
    assert [m.block_pool.blocks[i].block_hash is not None for i in m.get_block_ids("a")] == [
        True,
        True,
        False,
    ]
    # The cached second block holds the committed tokens 4..7, so another request hits it.
    other = Req("o", list(range(8)) + [9])
    assert m.get_computed_blocks(other)[1] == 8


def test_chunked_prefill_caches_as_blocks_fill() -> None:
    m = make()
    r = Req("a", list(range(14)))
    assert schedule_prompt(m, r, budget=6) == [1, 2]
    assert len(r.block_hashes) == 3 and m.block_pool.blocks[1].block_hash is not None
    assert m.block_pool.blocks[2].block_hash is None  # only 2 of its tokens computed so far
    new = m.allocate_slots(r, 6)
    r.num_computed_tokens += 6
    assert new is not None and new.get_block_ids() == [3]
    assert [m.block_pool.blocks[i].block_hash is not None for i in (1, 2, 3)] == [True, True, True]


def test_preempted_request_hits_its_own_blocks() -> None:
    m = make()
    r = Req("a", list(range(10)))
    schedule_prompt(m, r)
    hashes = list(r.block_hashes)
    m.free(r)
    r.num_computed_tokens = 0
    hits, n_hit = m.get_computed_blocks(r)
    assert n_hit == 8 and hits.get_block_ids() == [1, 2] and r.block_hashes == hashes


def test_duplicate_blocks_of_concurrent_identical_prompts() -> None:
    m = make()
    a, b = Req("a", list(range(9))), Req("b", list(range(9)))
    # Both scheduled before either is cached (same step): both miss.
    ha, na = m.get_computed_blocks(a)
    hb, nb = m.get_computed_blocks(b)
    assert na == nb == 0
    m.allocate_slots(a, 9, na, ha)
    m.allocate_slots(b, 9, nb, hb)
    # Only the first copy is registered; the second stays an ordinary block.
    assert m.block_pool.blocks[1].block_hash is not None and m.block_pool.blocks[4].block_hash is None
    m.free(a)
    m.free(b)
    assert m.get_computed_blocks(Req("c", list(range(9))))[0].get_block_ids() == [1, 2]


def test_usage_accounting() -> None:
    m = make(num_blocks=9)  # 8 usable
    a = Req("a", list(range(8)))
    schedule_prompt(m, a)
    assert m.usage == pytest.approx(2 / 8)
    b = Req("b", list(range(8)))
    schedule_prompt(m, b)  # shares one full block (the cap keeps the second recomputed)
    assert m.usage == pytest.approx(3 / 8)
    m.free(a)
    assert m.usage == pytest.approx(2 / 8)
    m.free(b)
    assert m.usage == 0.0 and m.num_free_blocks == 8


def test_reset_prefix_cache_and_stats() -> None:
    m = make()
    a = Req("a", list(range(10)))
    schedule_prompt(m, a)
    b = Req("b", list(range(10)))
    _hits, n_hit = m.get_computed_blocks(b)
    assert n_hit == 8
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)
    assert stats.hit_rate == pytest.approx(0.4) and not stats.reset
    assert m.make_prefix_cache_stats().queries == 0  # interval counters restart
    assert m.reset_prefix_cache() is False  # a still holds blocks
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert m.get_computed_blocks(Req("c", list(range(10))))[1] == 0
    stats = m.make_prefix_cache_stats()
    assert stats.reset and stats.queries == 10 and stats.hits == 0
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (30, 8)


def test_caching_disabled() -> None:
    m = make(caching=False)
    a = Req("a", list(range(10)))
    schedule_prompt(m, a)
    m.free(a)
    hits, n_hit = m.get_computed_blocks(Req("b", list(range(10))))
    assert n_hit == 0 and not hits
    assert a.block_hashes == [] and all(b.block_hash is None for b in m.block_pool.blocks)
    assert m.make_prefix_cache_stats().queries == 0


def test_bad_arguments_are_typed_errors() -> None:
    m = make()
    r = Req("a", list(range(10)))
    with pytest.raises(ValueError, match=">= 0"):
        m.allocate_slots(r, -1)
    schedule_prompt(m, r)
    hits, _ = m.get_computed_blocks(Req("b", list(range(10))))
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        m.allocate_slots(Req("b", list(range(10))), 2, 0, hits)
    # Hits for a request that already holds blocks: rejected before any reference is taken.
    with pytest.raises(ValueError, match="already holds blocks"):
        m.allocate_slots(r, 2, 8, hits)
    assert [b.ref_cnt for b in hits.blocks] == [1, 1]


def test_spec_kind_dispatch() -> None:
    class MyManager(FullAttentionManager):
        pass

    class OddSpec(FullAttentionSpec):
        kind = "odd"

    with pytest.raises(KVCacheConfigError, match="'odd'"):
        KVCacheManager(OddSpec(BS, torch.float16), 8)
    m = KVCacheManager(OddSpec(BS, torch.float16), 8, manager_classes={"odd": MyManager})
    assert type(m.single_type_manager) is MyManager
    mla: KVCacheSpec = MLALatentSpec(BS, torch.float16, kv_lora_rank=8, qk_rope_head_dim=4)
    assert type(KVCacheManager(mla, 8).single_type_manager) is FullAttentionManager
