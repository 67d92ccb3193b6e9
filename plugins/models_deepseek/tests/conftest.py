# The repo runs pytest with --import-mode=importlib, which does not put test directories on sys.path;
# the helper module beside these tests is imported by name, so add this directory explicitly.
import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(autouse=True)
def _moe_torch_reference_by_default(monkeypatch):
    # Another plugin's conftest may switch Triton's interpreter on for the whole session; MoE tests here
    # choose the Triton path explicitly (TRITON_INTERPRET=1 in the test), everything else runs torch.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
