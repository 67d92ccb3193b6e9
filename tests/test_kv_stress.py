"""Randomized allocate / decode / speculate / preempt / free sequences against pool invariants.

Besides the bookkeeping invariants, a shadow of "what KV each block holds" is kept: whenever a block's
tokens are computed the shadow records the exact token prefix (and salt) they belong to, and every
prefix-cache hit must return blocks whose shadow matches the hitting request's tokens.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from kv_test_utils import Req

from keel.kv_cache.manager import KVCacheManager
from keel.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

BS = 4


def check_invariants(m: KVCacheManager) -> None:
    pool = m.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    assert len(free) == pool.get_num_free_blocks() == len({b.block_id for b in free})
    assert pool.null_block not in free and pool.null_block.ref_cnt == 0
    held = Counter(
        b.block_id for blocks in m.single_type_manager.req_to_blocks.values() for b in blocks if not b.is_null
    )
    free_ids = {b.block_id for b in free}
    for b in pool.blocks[1:]:
        assert b.ref_cnt >= 0
        assert b.ref_cnt == held[b.block_id], b
        assert (b.ref_cnt == 0) == (b.block_id in free_ids), b
    for (h, gid), b in pool.cached_block_hash_to_block.items():
        assert b.block_hash == h and b.group_id == gid and not b.is_null
    cached = [b for b in pool.blocks if b.block_hash is not None]
    assert len(cached) == len(pool.cached_block_hash_to_block)
    assert m.usage == pytest.approx(1 - len(free) / (pool.num_blocks - 1))


def run_random(spec: KVCacheSpec, seed: int, caching: bool, steps: int = 400) -> tuple[int, int]:
    rng = random.Random(seed)
    m = KVCacheManager(spec, num_blocks=rng.randint(6, 24), enable_caching=caching)
    window = getattr(spec, "sliding_window", None)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(0, 14))] for _ in range(3)]
    shadow: dict[int, tuple] = {}
    waiting: list[Req] = []
    running: list[Req] = []
    num_hits = num_preempted = 0

    def record(r: Req) -> None:
        # The step ran: every full block of committed, computed tokens now holds exactly those tokens.
        table = m.single_type_manager.req_to_blocks[r.request_id]
        for i in range(min(r.num_computed_tokens, r.num_tokens) // BS):
            if not table[i].is_null:
                shadow[table[i].block_id] = (r.cache_salt, tuple(r.all_token_ids[: (i + 1) * BS]))

    def check_window(r: Req) -> None:
        # Right after allocation: the tokens about to be computed read from this position on.
        if window is None:
            return
        table = m.single_type_manager.req_to_blocks[r.request_id]
        first_read = max(r.num_computed_tokens - window + 1, 0)
        assert not any(b.is_null for b in table[first_read // BS :]), (r, table)

    def preempt(r: Req) -> None:
        nonlocal num_preempted
        m.free(r)
        r.num_computed_tokens = 0
        running.remove(r)
        waiting.append(r)
        num_preempted += 1

    for step in range(steps):
        op = rng.random()
        if op < 0.25 or not (waiting or running):
            tokens = list(rng.choice(prefixes)) + [rng.randrange(50) for _ in range(rng.randint(1, 10))]
            waiting.append(Req(f"r{step}", tokens, cache_salt=rng.choice([None, None, "s"])))
        if waiting and rng.random() < 0.5:
            r = waiting[0]
            hits, n_hit = m.get_computed_blocks(r)
            assert n_hit % BS == 0 and n_hit <= r.num_tokens - 1 and len(hits) * BS == n_hit
            for i, b in enumerate(hits.blocks):
                if b.is_null:
                    # Null padding only where the first computed token's window cannot reach.
                    assert window is not None and (i + 1) * BS <= n_hit - window + 1
                else:
                    assert shadow[b.block_id] == (r.cache_salt, tuple(r.all_token_ids[: (i + 1) * BS]))
            num_hits += n_hit > 0
            chunk = rng.randint(1, r.num_tokens - n_hit)
            if m.allocate_slots(r, chunk, n_hit, hits) is not None:
                waiting.pop(0)
                r.num_computed_tokens = n_hit
                check_window(r)
                r.num_computed_tokens += chunk
                running.append(r)
                record(r)
        elif running:
            r = rng.choice(running)
            if rng.random() < 0.15:
                m.free(r)
                running.remove(r)
            elif r.num_computed_tokens < r.num_tokens:  # chunked prefill continues
                chunk = rng.randint(1, r.num_tokens - r.num_computed_tokens)
                if m.allocate_slots(r, chunk) is None:
                    preempt(r)
                else:
                    check_window(r)
                    r.num_computed_tokens += chunk
                    record(r)
            else:  # decode with k speculative drafts as lookahead, then accept some
                r.all_token_ids.append(rng.randrange(50))
                k = rng.choice([0, 0, 1, 3])
                if m.allocate_slots(r, 1, num_lookahead_tokens=k) is None:
                    preempt(r)
                else:
                    check_window(r)
                    accepted = [rng.randrange(50) for _ in range(rng.randint(0, k))]
                    r.num_computed_tokens += 1 + len(accepted)
                    r.all_token_ids.extend(accepted)
                    record(r)
        check_invariants(m)
    for r in running:
        m.free(r)
    check_invariants(m)
    assert m.num_free_blocks == m.block_pool.num_blocks - 1
    assert m.reset_prefix_cache()
    return num_hits, num_preempted


SPECS = [
    FullAttentionSpec(BS, torch.float16, 1, 4),
    SlidingWindowSpec(BS, torch.float16, 1, 4, sliding_window=6),
    SlidingWindowSpec(BS, torch.float16, 1, 4, sliding_window=9),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{getattr(s, 'sliding_window', 0)}")
def test_random_sequences_keep_invariants(spec: KVCacheSpec) -> None:
    total_hits = total_preempted = 0
    for seed in range(12):
        hits, preempted = run_random(spec, seed, caching=seed % 4 != 3)
        total_hits += hits
        total_preempted += preempted
    # The workload must actually exercise prefix hits and preemption.
    assert total_hits > 10 and total_preempted > 10
