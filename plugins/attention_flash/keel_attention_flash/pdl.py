"""Programmatic dependent launch (PDL, sm_90+) for the attention kernels: each takes `PDL: tl.constexpr` and
starts with `pdl_enter(PDL)` -- wait for the previous kernel's writes before touching memory, then let the
next PDL launch start -- so its launch overlaps the tail of the kernel before it (a batch-1 decode step is
hundreds of small kernels). kernels-triton's `pdl` module does the same for its kernels and says more;
this plugin keeps its own copy so it needs no other plugin. `ENABLED`: module state for benchmarks that
measure the difference (`h200_step_profile.py --no-pdl`).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = True


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


@functools.cache
def _triton_has_pdl() -> bool:
    """Whether this Triton can launch with PDL (its `launch_pdl` option and `gdc_wait`); older ones launch plainly."""
    try:
        import triton.language.extra.cuda as cuda_ext
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}) and hasattr(cuda_ext, "gdc_wait")


def pdl_kwargs(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel on `t`'s device: PDL on CUDA sm_90+ when ENABLED and not interpreted
    (the interpreter has no inline assembly), else none (`PDL` defaults to False)."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")
    if not ENABLED or t.device.type != "cuda" or interpreted or not _triton_has_pdl():
        return {}
    on = _sm90(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return {"PDL": True, "launch_pdl": True} if on else {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a kernel: wait for the previous kernel's writes, then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
