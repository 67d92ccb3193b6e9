"""Programmatic dependent launch (PDL, sm_90+) for this plugin's kernels.

A kernel launched with `launch_pdl=True` may start while the kernel before it in the stream is still
running; it must not touch memory before `griddepcontrol.wait`, which returns once that kernel has finished
and its writes are visible. So the kernels that use it (all but the token bitmask and the quantized MoE GEMM)
take `PDL: tl.constexpr` and call `pdl_enter(PDL)` (the fused-MoE ones the same wait inline) before their
first load or store; `pdl_enter` also signals the next PDL launch that it may start (its own wait still
holds it back until this kernel is done). Why: a decode step at batch 1 is ~400-500 small kernels whose
launch latency and ramp, not their bytes, are much of the step; PDL overlaps each launch with the tail of
the kernel before (captured in CUDA graphs as programmatic edges). Kernels after a non-PDL kernel (cuBLAS)
still wait for it: the wait is on whatever ran before.

`ENABLED` is module state for benchmarks that measure the difference (`h200_step_profile.py --no-pdl`); the
launchers read it through `launch_pdl(device)`, which is also False off CUDA, before sm_90, and under the
interpreter (it has no inline assembly).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from keel_kernels_triton.support import interpreter_enabled

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


def launch_pdl(device: torch.device) -> bool:
    """Whether this plugin's launches on `device` use PDL (pass as both `PDL=` and `launch_pdl=`)."""
    if not ENABLED or device.type != "cuda" or interpreter_enabled() or not _triton_has_pdl():
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device())


def pdl_kwargs(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel whose tensors live on `t`'s device: PDL on where `launch_pdl` says, else
    none (the kernel's `PDL` defaults to False)."""
    return {"PDL": True, "launch_pdl": True} if launch_pdl(t.device) else {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a kernel: wait for the previous kernel's writes, then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
