import os
import sys
from pathlib import Path

import pytest
import torch

# Triton binds its jitted helpers (tl.sum, ...) to the mode it is first imported in: the tests that bind
# kernels-triton's ops on the CPU need that to be the interpreter (the fixture below turns it off per test).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The repo runs pytest with --import-mode=importlib, which does not put test directories on sys.path;
# the helper module beside these tests is imported by name, so add this directory explicitly.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(autouse=True)
def _interpreter_off_by_default(monkeypatch):
    # With the interpreter on, "auto" could pick the interpreted triton_mla here; tests that want
    # interpreted kernels (kernels-triton's MoE ops bound on the CPU) set TRITON_INTERPRET=1 themselves.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
