"""kernels-triton as a plugin: manifest, lazy import, registry, `supports`."""

import subprocess
import sys

import torch
from keel_kernels_triton import manifest
from keel_kernels_triton.ops import TritonRMSNorm, TritonSiluAndMul

from keel.layers.custom_op import CUSTOM_OP_NAMES, CustomOpProvider
from keel.plugins.loader import load_plugins


def test_manifest_provides_every_core_op():
    m = manifest()
    assert (m.name, m.core_api) == ("kernels-triton", ">=1.0,<2")
    assert set(m.provides["custom_op"]) == set(CUSTOM_OP_NAMES)


def test_manifest_module_imports_no_torch_or_triton():
    code = ("import sys, keel_kernels_triton; keel_kernels_triton.manifest(); "
            "print('torch' in sys.modules or 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_registry_resolves_providers():
    registry = load_plugins(["kernels-triton"]).registry("custom_op")
    assert registry.get("rms_norm") is TritonRMSNorm
    for name in CUSTOM_OP_NAMES:
        assert isinstance(registry.get(name)(), CustomOpProvider)


def test_supports_cuda_and_the_interpreter_only(monkeypatch):
    op = TritonSiluAndMul()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert op.supports("cuda", dtype)
    assert not op.supports("cuda", torch.float64) and not op.supports("xpu", torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not op.supports("cpu", torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert op.supports("cpu", torch.float32)
