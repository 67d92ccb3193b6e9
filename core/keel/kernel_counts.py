"""Per-device int32 counters for kernels whose last program to finish completes the launch's work: a split-K
GEMM's tile sum (the quantization plugin's `splitk_reduce.store_tile`), split-K decode attention's merge
(triton_flash's `split_decode_kernel`). Each program counts itself with an atomic; the one that completes a count
does the work and puts the count back to 0, so the next launch -- a CUDA-graph replay included -- finds zeros.
Launches sharing the counters must run one after another: keel runs its forward on one stream. Torch only (the
core imports no kernel language); the kernels are the plugins'."""

from __future__ import annotations

import torch

MAX_COUNTS = 1 << 16
_COUNTS: dict[torch.device, torch.Tensor] = {}


def kernel_counts(device: torch.device, needed: int) -> torch.Tensor:
    """Called by a kernel's launcher before each launch: the device's int32 [MAX_COUNTS] zeros, of which the launch
    uses `needed` (refused past MAX_COUNTS). Allocated on first use, which must be outside a CUDA graph's capture
    (the engine's warm-up runs every shape eagerly before it captures): an allocation inside would tie the counters
    to the graph's memory pool."""
    if needed > MAX_COUNTS:
        raise ValueError(f"a launch needs {needed} counters (one per output tile), more than the {MAX_COUNTS} kept")
    counts = _COUNTS.get(device)
    if counts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("kernel counters first needed inside a CUDA graph capture: run the shape eagerly first "
                               "(the engine's warm-up does)")
        counts = _COUNTS[device] = torch.zeros(MAX_COUNTS, dtype=torch.int32, device=device)
    return counts
