"""torch_paged as a plugin: manifest, discovery through the registry, typed errors."""

import subprocess
import sys

import pytest
import torch
from keel_attention_torch import manifest
from keel_attention_torch.backend import TorchPagedAttentionBackend, UnsupportedLayerError

from keel.attention.backend import AttentionLayerConfig, BackendRequest
from keel.kv_cache.spec import MLALatentSpec
from keel.plugins.loader import load_plugins


def test_manifest_fields():
    m = manifest()
    assert (m.name, m.version, m.core_api) == ("attention-torch", "0.1.0", ">=1.0,<2")
    assert dict(m.provides["attention_backend"]) == {
        "torch_paged": "keel_attention_torch.backend:TorchPagedAttentionBackend",
        "torch_mla": "keel_attention_torch.mla:TorchMLABackend",
    }


def test_manifest_module_imports_no_torch():
    code = "import sys, keel_attention_torch; keel_attention_torch.manifest(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_registry_resolves_backend():
    plugins = load_plugins(["attention-torch"])
    assert plugins.registry("attention_backend").get("torch_paged") is TorchPagedAttentionBackend


def _layer(**kw) -> AttentionLayerConfig:
    fields = {"num_heads": 4, "num_kv_heads": 2, "head_size": 64, "scale": 0.125, "dtype": torch.float32}
    return AttentionLayerConfig(**{**fields, "block_size": 16, **kw})


def test_validate_rejects_heads_not_divisible():
    reasons = TorchPagedAttentionBackend.validate(BackendRequest(_layer(num_kv_heads=3), "cpu", "full_attention"))
    assert any("multiple of num_kv_heads" in r for r in reasons)


def test_validate_accepts_any_device_and_odd_sizes():
    layer = _layer(head_size=72, block_size=7, dtype=torch.bfloat16)
    for device_type in ("cpu", "cuda", "xpu"):
        assert TorchPagedAttentionBackend.validate(BackendRequest(layer, device_type, "full_attention")) == []


def test_get_impl_rejects_unsupported_layer_with_reasons():
    with pytest.raises(UnsupportedLayerError, match="soft cap"):
        TorchPagedAttentionBackend.get_impl(_layer(logits_soft_cap=30.0))


def test_kv_cache_shape_rejects_mla_spec():
    spec = MLALatentSpec(16, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64)
    with pytest.raises(UnsupportedLayerError, match="MLA"):
        TorchPagedAttentionBackend.kv_cache_shape(4, spec)
