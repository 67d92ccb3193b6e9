"""Writing into a paged cache of any storage dtype."""

from __future__ import annotations

import torch


def store_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache[slots] = values, cast to the cache's dtype. cache: [num_slots, ...]; slots: [n] int64;
    values: [n, ...]. fp8 caches are written through a uint8 view: the CPU has no fp8 index_copy_."""
    values = values.to(cache.dtype)
    if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        cache.view(torch.uint8).index_copy_(0, slots, values.view(torch.uint8))
    else:
        cache.index_copy_(0, slots, values)
