"""What the KV cache manager needs from a request, and its typed errors.

The manager never imports the engine's `Request`: anything with these attributes works, which keeps the
KV cache usable from tests, benchmarks and KV connectors without the scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from keel.kv_cache.hashing import BlockHash


@runtime_checkable
class KVCacheRequest(Protocol):
    """The view of a request the KV cache manager reads (and, for `block_hashes`, appends to).

    `all_token_ids` holds committed tokens only (prompt + accepted outputs), never speculative drafts,
    and only ever grows while the request lives. `block_hashes` is owned by the request but filled by the
    manager, one entry per full block of `all_token_ids`, so hashes are computed once per block for the
    request's lifetime (preemption keeps them). A request may also carry `cache_salt: str | None`; it is
    read with `getattr` so requests without it need not declare it.
    """

    @property
    def request_id(self) -> str: ...

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> list[BlockHash]: ...


class KVCacheConfigError(ValueError):
    """The KV cache was configured in a way it cannot work with (too few blocks, unknown spec kind)."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)
