"""Physical KV cache blocks and the block lists the manager hands to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from keel.kv_cache.hashing import BlockHash, BlockHashWithGroupId


class KVCacheBlock:
    """One physical block of the paged KV cache (the same id in every layer of its cache group).

    `ref_cnt` counts the running requests whose block tables hold it; a block with `ref_cnt == 0` sits
    in the pool's free queue (and may still be a prefix-cache hit until it is evicted). `block_hash` is
    set while the block is registered in the prefix cache, None otherwise. The null block (id 0) is a
    padding entry for block tables: never allocated, never freed, never cached.
    """

    __slots__ = (
        "block_hash",
        "block_id",
        "group_id",
        "is_null",
        "next_free_block",
        "prev_free_block",
        "ref_cnt",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.group_id = 0  # the KV cache group the hash was registered for; meaningful with block_hash
        self.is_null = False
        # Links of the pool's free queue (doubly linked list); both None while the block is in use.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    @property
    def cache_key(self) -> BlockHashWithGroupId | None:
        return None if self.block_hash is None else (self.block_hash, self.group_id)

    def reset_hash(self) -> None:
        self.block_hash = None

    def __repr__(self) -> str:
        # Not the dataclass default: that would recurse through the free-queue links.
        h = None if self.block_hash is None else self.block_hash.hex()[:8]
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h}, null={self.is_null})"


@dataclass
class KVCacheBlocks:
    """Blocks the manager returns to the scheduler: a prefix-cache hit or a step's new allocation.

    Holds the blocks of the single KV cache group in block-table order. When several groups exist,
    per-group lists are added as a field; `blocks` / `get_block_ids` keep meaning group 0, so callers
    written now stay correct.
    """

    blocks: list[KVCacheBlock] = field(default_factory=list)

    def get_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(self.blocks + other.blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    def __bool__(self) -> bool:
        return bool(self.blocks)
