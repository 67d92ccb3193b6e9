"""triton_flash as a plugin: manifest, registry, validation reasons."""

import subprocess
import sys

import torch
from keel_attention_flash import manifest
from keel_attention_flash.backend import TritonFlashAttentionBackend, UnsupportedLayerError

from keel.attention.backend import AttentionLayerConfig, BackendRequest
from keel.kv_cache.spec import MLALatentSpec
from keel.plugins.loader import load_plugins


def _layer(**kw) -> AttentionLayerConfig:
    fields = {"num_heads": 4, "num_kv_heads": 2, "head_size": 64, "scale": 0.125, "dtype": torch.bfloat16}
    return AttentionLayerConfig(**{**fields, "block_size": 16, **kw})


def test_manifest_fields():
    m = manifest()
    assert (m.name, m.core_api) == ("attention-flash", ">=1.0,<2")
    assert dict(m.provides["attention_backend"]) == {
        "triton_flash": "keel_attention_flash.backend:TritonFlashAttentionBackend",
        "triton_mla": "keel_attention_flash.mla_backend:TritonMLABackend",
    }


def test_manifest_module_imports_no_torch_or_triton():
    code = ("import sys, keel_attention_flash; keel_attention_flash.manifest(); "
            "print('torch' in sys.modules or 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_registry_resolves_backend():
    plugins = load_plugins(["attention-flash"])
    assert plugins.registry("attention_backend").get("triton_flash") is TritonFlashAttentionBackend


def test_cpu_without_interpreter_is_rejected_with_a_reason(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reasons = TritonFlashAttentionBackend.validate(BackendRequest(_layer(), "cpu", "full_attention"))
    assert any("TRITON_INTERPRET=1" in r for r in reasons)
    assert TritonFlashAttentionBackend.validate(BackendRequest(_layer(), "cuda", "full_attention")) == []


def test_rejects_unsupported_shapes():
    for bad in (_layer(head_size=80), _layer(block_size=8), _layer(num_kv_heads=3), _layer(dtype=torch.float64)):
        assert TritonFlashAttentionBackend.validate(BackendRequest(bad, "cuda", "full_attention"))
    try:
        TritonFlashAttentionBackend.get_impl(_layer(head_size=96))
    except UnsupportedLayerError as exc:
        assert "head size 96" in str(exc)
    else:
        raise AssertionError("get_impl accepted head size 96")


def test_mla_spec_rejected():
    spec = MLALatentSpec(block_size=16, dtype=torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64)
    try:
        TritonFlashAttentionBackend.kv_cache_shape(4, spec)
    except UnsupportedLayerError as exc:
        assert "MLA" in str(exc)
    else:
        raise AssertionError("MLA spec accepted")
