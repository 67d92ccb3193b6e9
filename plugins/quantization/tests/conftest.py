# The repo runs pytest with --import-mode=importlib, which does not put test directories on sys.path;
# the helper module beside these tests is imported by name, so add this directory explicitly.
import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# Without a GPU the Triton kernels run through the interpreter; it must be on before they are compiled
# (`triton.jit` reads it when the kernels module is imported), as in kernels_triton's tests.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
