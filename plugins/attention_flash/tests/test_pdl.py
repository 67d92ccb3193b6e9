"""Programmatic dependent launch (keel_attention_flash.pdl): every attention kernel that takes `PDL` waits
before its first load or store (its first statement is `pdl_enter(PDL)`), and the launch keywords are PDL
only on CUDA sm_90+, with the module switch on, outside the interpreter."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch
from keel_attention_flash import kernels, mla_kernels, pdl


def test_every_pdl_kernel_waits_before_touching_memory():
    seen = []
    for module in (kernels, mla_kernels):
        for node in ast.parse(inspect.getsource(module)).body:
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args):
                seen.append(node.name)
                body = node.body
                if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                    body = body[1:]  # the docstring
                first = body[0]
                assert (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
                        and getattr(first.value.func, "id", None) == "pdl_enter"), node.name
    assert {"reshape_and_cache_kernel", "rope_and_cache_kernel", "varlen_paged_attention_kernel", "split_decode_kernel",
            "split_reduce_kernel", "mla_write_latent_kernel", "mla_attention_kernel",
            "mla_split_reduce_kernel"} <= set(seen)


def test_launch_keywords(monkeypatch):
    assert pdl.pdl_kwargs(torch.zeros(1)) == {}
    fake_cuda = type("T", (), {"device": torch.device("cuda", 0)})()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for capability, want in (((8, 9), {}), ((9, 0), {"PDL": True, "launch_pdl": True})):
        pdl._sm90.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, c=capability: c)
        assert pdl.pdl_kwargs(fake_cuda) == want
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.pdl_kwargs(fake_cuda) == {}
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.pdl_kwargs(fake_cuda) == {}
    pdl._sm90.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_this_gpu_launches_with_pdl_from_sm90():
    want = torch.cuda.get_device_capability() >= (9, 0)
    assert bool(pdl.pdl_kwargs(torch.zeros(1, device="cuda"))) == want
