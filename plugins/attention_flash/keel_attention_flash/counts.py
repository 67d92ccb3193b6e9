"""Per-device int32 counters for kernels whose last program to finish merges the others' partials in the same
launch (split-K decode: `kernels.split_decode_kernel`). Each count returns to 0 as its merge is written, so the
launches of one stream, CUDA-graph replays included, reuse them; kernels on concurrent streams must not share them
(keel runs its forward on one stream). The quantization plugin's split-K GEMMs keep counters of their own
(`keel_quantization.splitk_reduce.tile_counts`): neither plugin needs the other."""

from __future__ import annotations

import torch

MAX_COUNTS = 1 << 16
_COUNTS: dict[torch.device, torch.Tensor] = {}


def split_counts(device: torch.device, needed: int) -> torch.Tensor:
    """The device's int32 [MAX_COUNTS] zeros, allocated on first use: outside a CUDA graph's capture (the
    engine's warm-up runs every decode shape eagerly before it captures), which an allocation inside would tie to
    the graph's memory pool."""
    if needed > MAX_COUNTS:
        raise ValueError(f"split-K decode: {needed} (request, KV head) tiles, more than the {MAX_COUNTS} counters")
    counts = _COUNTS.get(device)
    if counts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split-K decode counters first needed inside a CUDA graph capture: run the shape "
                               "eagerly first (the engine's warm-up does)")
        counts = _COUNTS[device] = torch.zeros(MAX_COUNTS, dtype=torch.int32, device=device)
    return counts
