"""Programmatic dependent launch (PDL, sm_90+) for the quantization kernels: each takes `PDL: tl.constexpr`
and starts with `pdl_enter(PDL)` -- wait for the previous kernel's writes before touching memory, then let
the next PDL launch start -- as kernels-triton's and attention-flash's kernels do (their `pdl` modules say
why; this plugin keeps its own copy so it needs no other plugin).

`ENABLED` is True, as on the other two plugins. Measured on an H100 SXM at e3a41fb
(`h100-quant-pdl-e3a41fb.json`, Llama-8B shape, dummy weights, one call, off then on): batch-1 decode step
GPTQ int4 g128 3.155 -> 2.954 ms wall, fp8 per-tensor 4.231 -> 4.034, fp8 at batch 256 8.431 -> 8.396; the
quantization GPU tests with it on passed as far as they ran (40 of tests/test_cuda_quant*.py's 44 before the
call's 230 s cut: 39 passed, 1 xfail-marked passed). KEEL_QUANT_PDL=0 turns it off for one process
(`h200_step_profile.py --no-pdl-quant` does the same in-process), to measure the difference.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# KEEL_QUANT_PDL=0 turns it off for a process (to measure the difference); anything but unset, 0 or 1 is
# refused, so a misspelt value never measures the wrong thing
_ENV = os.environ.get("KEEL_QUANT_PDL", "1").strip()
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
