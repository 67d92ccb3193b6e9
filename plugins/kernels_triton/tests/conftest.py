"""Without a GPU the Triton kernels run through the interpreter; it must be on before they are compiled
(`triton.jit` reads it when the kernels module is imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
