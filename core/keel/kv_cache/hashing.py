"""Prefix-cache block hashes: a chain of sha256 digests over full blocks of committed tokens.

A full block's hash is `sha256(pickle((parent_hash, token_ids, extra_keys)))`. Chaining the parent hash
makes a block's hash identify its whole prefix, so a single dictionary lookup per block finds a cached
prefix. Why sha256 and not Python's `hash()`:
- it is stable across processes and runs (Python salts `str` hashes per process), so an engine-core
  process, a worker or a KV connector computing the hash of the same tokens gets the same key;
- 256 bits make an accidental collision (which would silently serve another prompt's KV) negligible,
  where a 64-bit `hash()` is not at the scale of a long-running server.
pickle is deterministic for the types hashed here (bytes, ints, strs and tuples of them) at a fixed
protocol. Extra keys distinguish equal tokens with different meaning; today that is `cache_salt`, mixed
into the first block only -- every later block inherits it through the parent chain.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any, NewType

from keel.kv_cache.utils import KVCacheRequest

BlockHash = NewType("BlockHash", bytes)
# The prefix-cache key: the same tokens in two KV cache groups (layers with different specs) are
# different cache entries, since each group has its own blocks.
BlockHashWithGroupId = tuple[BlockHash, int]

_PICKLE_PROTOCOL = 5
# Parent of a request's first block. A constant (not a per-process random seed) so hashes are stable
# across processes; salting per tenant is what `cache_salt` is for.
NONE_HASH = BlockHash(hashlib.sha256(b"keel.kv_cache.root").digest())


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block of a request)."""
    parent = NONE_HASH if parent_block_hash is None else parent_block_hash
    payload = pickle.dumps((parent, tuple(token_ids), extra_keys), protocol=_PICKLE_PROTOCOL)
    return BlockHash(hashlib.sha256(payload).digest())


def block_extra_keys(request: KVCacheRequest, block_index: int) -> tuple[Any, ...] | None:
    """Extra hash keys of block `block_index` of `request` (None when there are none)."""
    if block_index != 0:
        return None
    salt = getattr(request, "cache_salt", None)
    return None if salt is None else (("cache_salt", salt),)


def update_block_hashes(request: KVCacheRequest, block_size: int) -> list[BlockHash]:
    """Append the hashes of `request`'s newly full blocks to `request.block_hashes`; return that list.

    Called by the KV cache manager before every prefix-cache lookup or cache registration. Incremental:
    blocks hashed before are never rehashed, so a decode step costs at most one hash per block filled.
    Only committed tokens (`all_token_ids`) are hashed, and only full blocks.
    """
    hashes = request.block_hashes
    num_full_blocks = request.num_tokens // block_size
    if len(hashes) >= num_full_blocks:
        return hashes
    token_ids = request.all_token_ids
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full_blocks):
        parent = hash_block_tokens(
            parent, token_ids[i * block_size : (i + 1) * block_size], block_extra_keys(request, i)
        )
        hashes.append(parent)
    return hashes
