"""Where kernels-triton's kernels run: CUDA, or the CPU through Triton's interpreter (tests); which dtypes.

Imports neither triton nor the kernels, so a provider's `supports` can be asked before anything is jitted.
"""

from __future__ import annotations

import os

import torch

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET is on (read as Triton reads it): kernels jitted now run in Python."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


class TritonOp:
    """Shared `supports` of the providers: float dtypes; CUDA, or the CPU when the interpreter is on."""

    def supports(self, device_type: str, dtype: torch.dtype) -> bool:
        if dtype not in SUPPORTED_DTYPES:
            return False
        return device_type == "cuda" or (device_type == "cpu" and interpreter_enabled())

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
