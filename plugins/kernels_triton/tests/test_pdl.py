"""Programmatic dependent launch (keel_kernels_triton.pdl): a kernel launched with it may run before the
kernel ahead of it has finished, so every kernel that takes `PDL` must wait before its first load or store
(checked here on the source: its first statement is the wait); and the launch keywords are PDL only on CUDA
sm_90+, with the module switch on, outside the interpreter."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch
from keel_kernels_triton import kernels, linear_small_m, pdl
from keel_kernels_triton.fused_moe import align, grouped_gemm, moe_sum, router_gemm, routing

MODULES = (kernels, linear_small_m, align, grouped_gemm, moe_sum, router_gemm, routing)


def _waits_first(fn: ast.FunctionDef) -> bool:
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Call):  # pdl_enter(PDL)
        return getattr(first.value.func, "id", None) == "pdl_enter"
    if isinstance(first, ast.If) and getattr(first.test, "id", None) == "PDL":  # if PDL: gdc_wait() ...
        call = first.body[0].value
        return isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "gdc_wait"
    return False


def test_every_pdl_kernel_waits_before_touching_memory():
    kernels_seen = []
    for module in MODULES:
        for node in ast.parse(inspect.getsource(module)).body:
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args):
                kernels_seen.append(node.name)
                assert _waits_first(node), f"{module.__name__}.{node.name} takes PDL but does not wait first"
    expected = {"rms_norm_kernel", "rotary_kernel", "mla_rope_kernel", "silu_and_mul_kernel", "_align_kernel",
                "_count_kernel", "_scatter_kernel", "_fused_moe_kernel", "_moe_sum_kernel", "_router_gemm_kernel",
                "_routing_kernel", "_linear_gemv_kernel"}
    assert expected <= set(kernels_seen), expected - set(kernels_seen)


def test_launch_keywords(monkeypatch):
    cpu = torch.zeros(1)
    assert pdl.pdl_kwargs(cpu) == {}  # off CUDA
    meta = torch.empty(1, device="meta")
    assert pdl.pdl_kwargs(meta) == {}
    fake_cuda = type("T", (), {"device": torch.device("cuda", 0)})()
    monkeypatch.setattr(pdl, "interpreter_enabled", lambda: False)
    for capability, want in (((8, 0), {}), ((9, 0), {"PDL": True, "launch_pdl": True})):
        pdl._sm90.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, c=capability: c)
        assert pdl.pdl_kwargs(fake_cuda) == want
    monkeypatch.setattr(pdl, "_triton_has_pdl", lambda: False)  # a Triton without launch_pdl / gdc_wait
    assert pdl.pdl_kwargs(fake_cuda) == {}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.pdl_kwargs(fake_cuda) == {}
    pdl._sm90.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is off on a GPU machine")
def test_interpreted_launches_never_ask_for_pdl():
    fake_cuda = type("T", (), {"device": torch.device("cuda", 0)})()
    assert pdl.interpreter_enabled() and pdl.pdl_kwargs(fake_cuda) == {}
