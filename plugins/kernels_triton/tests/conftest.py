"""Without a GPU the Triton kernels run through the interpreter; it must be on before they are compiled
(`triton.jit` reads it when the kernels module is imported). The MoE kernels are jitted per interpreter
mode on first use, so their tests switch it on per test (`interpret`)."""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# --import-mode=importlib does not put test directories on sys.path; triton_test_utils is imported by name.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture
def interpret(monkeypatch):
    """Interpreted Triton on CPU tensors: the CPU machine's check of the MoE kernels. A GPU machine runs
    them compiled (the *_gpu tests), and its Triton's interpreter may differ, so these skip there."""
    if torch.cuda.is_available():
        pytest.skip("interpreted Triton on CPU tensors; the CUDA tests cover the compiled kernels")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
