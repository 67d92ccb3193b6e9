"""Prefix hashing: chained, stable across processes, salted, incremental, full blocks only."""

from __future__ import annotations

import os
import subprocess
import sys

from kv_test_utils import Req

from keel.kv_cache import hashing
from keel.kv_cache.hashing import NONE_HASH, hash_block_tokens, update_block_hashes


def test_hash_chains_parent_and_tokens() -> None:
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(NONE_HASH, (1, 2, 3, 4))
    assert len(h1) == 32
    assert hash_block_tokens(h1, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert hash_block_tokens(None, [1, 2, 3, 4], ("x",)) != h1
    assert hash_block_tokens(None, [1, 2, 3, 5]) != h1


def test_hash_is_stable_across_processes() -> None:
    # str hashing is salted per process in Python; our hashes must not be.
    code = (
        "from keel.kv_cache.hashing import hash_block_tokens as h;"
        "print(h(h(None, [1, 2], (('cache_salt', 'abc'),)), [3, 4]).hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    local = hash_block_tokens(hash_block_tokens(None, [1, 2], (("cache_salt", "abc"),)), [3, 4]).hex()
    assert outs == {local}


def test_update_hashes_full_blocks_only_and_salt() -> None:
    r = Req("a", list(range(10)))
    hashes = update_block_hashes(r, block_size=4)
    assert hashes is r.block_hashes and len(hashes) == 2  # tokens 8, 9 form a partial block
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    salted = Req("b", list(range(10)), cache_salt="tenant-1")
    update_block_hashes(salted, 4)
    # The salt is mixed into the first block and inherited by every later one through the chain.
    assert salted.block_hashes[0] != hashes[0] and salted.block_hashes[1] != hashes[1]
    assert salted.block_hashes[1] == hash_block_tokens(salted.block_hashes[0], [4, 5, 6, 7])


def test_update_hashes_is_incremental(monkeypatch) -> None:
    calls = []
    real = hashing.hash_block_tokens

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(hashing, "hash_block_tokens", counting)
    r = Req("a", list(range(7)))
    update_block_hashes(r, 4)
    assert len(calls) == 1
    update_block_hashes(r, 4)
    assert len(calls) == 1  # nothing new to hash
    r.all_token_ids.append(7)
    update_block_hashes(r, 4)
    assert len(calls) == 2 and list(calls[-1]) == [4, 5, 6, 7]
    assert r.block_hashes[1] == real(r.block_hashes[0], [4, 5, 6, 7])
