"""Writing into a paged cache of any storage dtype."""

from __future__ import annotations

import torch

from keel.layers.kv_scales import quantize_kv

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def store_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor,
                scale: torch.Tensor | None = None) -> None:
    """cache[slots] = values, cast to the cache's dtype (fp8: divided by the layer's `scale` [1] and
    saturated). cache: [num_slots, ...]; slots: [n] int64; values: [n, ...]. fp8 caches are written through
    a uint8 view: the CPU has no fp8 index_copy_."""
    fp8 = cache.dtype in FP8_DTYPES
    values = quantize_kv(values, scale, cache.dtype) if fp8 and scale is not None else values.to(cache.dtype)
    if fp8:
        cache.view(torch.uint8).index_copy_(0, slots, values.view(torch.uint8))
    else:
        cache.index_copy_(0, slots, values)


def read_cache(entries: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache entries in `dtype`: fp8 ones as (value * scale) rounded once to `dtype`."""
    if entries.dtype in FP8_DTYPES and scale is not None:
        return (entries.float() * scale).to(dtype)
    return entries.to(dtype)
