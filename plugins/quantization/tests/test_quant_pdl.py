"""Programmatic dependent launch for the quantization kernels (keel_quantization.pdl): every kernel that
takes `PDL` waits before its first load or store (its first statement is `pdl_enter(PDL)`, checked on the
source); the launch keywords are PDL only with the module switch on (on by default,
KEEL_QUANT_PDL=0 turns it off), on CUDA
sm_90+, outside the interpreter."""

from __future__ import annotations

import ast
import inspect
import os

import pytest
import torch

pytest.importorskip("triton")
from keel_quantization import (  # noqa: E402
    fp8_gemv_triton,
    fp8_quant_triton,
    fp8_triton,
    fp8_w8a8_small_m_triton,
    int4_dequant_triton,
    int4_gemv_fold_triton,
    int4_gemv_triton,
    int4_triton,
    pdl,
    splitk_reduce,
)

MODULES = (fp8_gemv_triton, fp8_quant_triton, fp8_triton, fp8_w8a8_small_m_triton, int4_dequant_triton,
           int4_gemv_fold_triton, int4_gemv_triton, int4_triton, splitk_reduce)


def test_every_pdl_kernel_waits_before_touching_memory():
    seen = []
    for module in MODULES:
        for node in ast.parse(inspect.getsource(module)).body:
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args):
                seen.append(node.name)
                body = node.body
                if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                    body = body[1:]  # the docstring
                first = body[0]
                assert (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
                        and getattr(first.value.func, "id", None) == "pdl_enter"), node.name
    assert {"_fp8_gemv_kernel", "_quant_fp8_kernel", "_quant_fp8_row_loop_kernel", "_fp8_gemm_kernel",
            "_fp8_w8a8_small_m_kernel", "_int4_dequant_kernel", "_int4_gemv_fold_kernel", "_int4_gemv_kernel",
            "_int4_gemm_kernel", "_splitk_reduce_kernel"} <= set(seen)


def test_launch_keywords(monkeypatch):
    fake_cuda = type("T", (), {"device": torch.device("cuda", 0)})()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    pdl._sm90.cache_clear()
    # on unless KEEL_QUANT_PDL=0 (measured on an H100: pdl.py's docstring)
    assert pdl.ENABLED == (os.environ.get("KEEL_QUANT_PDL", "1").strip() == "1")
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.pdl_kwargs(fake_cuda) == {}
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.pdl_kwargs(fake_cuda) == {"PDL": True, "launch_pdl": True}
    assert pdl.pdl_kwargs(torch.zeros(1)) == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.pdl_kwargs(fake_cuda) == {}
    pdl._sm90.cache_clear()
