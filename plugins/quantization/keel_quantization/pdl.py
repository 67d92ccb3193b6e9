"""Programmatic dependent launch (PDL, sm_90+) for the quantization kernels: each takes `PDL: tl.constexpr`
and starts with `pdl_enter(PDL)` -- wait for the previous kernel's writes before touching memory, then let
the next PDL launch start -- as kernels-triton's and attention-flash's kernels do (their `pdl` modules say
why; this plugin keeps its own copy so it needs no other plugin).

`ENABLED` is False: the H200 measured PDL on the other two plugins (h200-pdl-2bcda9d.json) but not yet on
these kernels, nor ran the GPU tests with it, so their launches stay plain until a device call measures them
(`h200_step_profile.py --pdl-quant` or KEEL_QUANT_PDL=1 turns it on for that process). Where every GEMM of a
decode step is one of these kernels (GPTQ / fp8 at batch 1) the gain should be larger than bf16 Llama's,
whose Triton kernels sit between cuBLAS GEMMs.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# KEEL_QUANT_PDL=1 turns it on for a process (device calls that run the GPU tests with it); anything else
# but unset or 0 is refused, so a misspelt value never measures the wrong thing
_ENV = os.environ.get("KEEL_QUANT_PDL", "0").strip()
if _ENV not in ("0", "1"):
    raise ValueError(f"KEEL_QUANT_PDL must be 0 or 1, got {_ENV!r}")
ENABLED = _ENV == "1"


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
