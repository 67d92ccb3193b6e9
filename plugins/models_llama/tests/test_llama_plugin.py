"""The plugin as the core sees it: a light manifest, registry entries, and the model's runner-facing API."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from keel_models_llama import manifest
from keel_models_llama.llama import LlamaForCausalLM, layer_sliding_window
from keel_models_llama.qwen2 import Qwen2ForCausalLM
from llama_test_utils import DenseSDPABackend, build_context

from keel.attention.backend import BackendRequest
from keel.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec
from keel.layers.attention import Attention
from keel.models.interface import CausalLM
from keel.testing.checkpoints import make_checkpoint

ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
EMBEDDING_ARCHS = ("LlamaModel", "Qwen2Model", "Qwen3Model")  # no LM head: pooling only


def test_manifest_declares_all_architectures() -> None:
    m = manifest()
    assert (m.name, m.core_api) == ("models-llama", ">=1.0,<2")
    assert set(m.provides["model_arch"]) == set(ARCHS) | set(EMBEDDING_ARCHS)


def test_manifest_module_imports_no_torch() -> None:
    code = "import sys, keel_models_llama; keel_models_llama.manifest(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_registry_resolves_every_architecture() -> None:
    from keel.plugins.loader import load_plugins

    registry = load_plugins(["models-llama"]).registry("model_arch")
    for arch in ARCHS:
        cls = registry.get(arch)
        assert issubclass(cls, LlamaForCausalLM) and cls.__name__ == arch
    from keel.models.capabilities import model_capabilities

    for arch in EMBEDDING_ARCHS:
        assert "pooling" in model_capabilities(registry.get(arch))


@pytest.fixture(scope="module")
def qwen2_sliding(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "qwen2"
    return make_checkpoint(
        "qwen2", path, num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1
    )


def test_attention_layers_in_order_with_specs(qwen2_sliding: Path) -> None:
    with torch.device("meta"):
        model = Qwen2ForCausalLM(build_context(qwen2_sliding))
    assert isinstance(model, CausalLM)
    layers = model.attention_layers()
    assert [layer.layer_idx for layer in layers] == [0, 1, 2]
    assert all(isinstance(layer, Attention) for layer in layers)
    specs = [layer.kv_cache_spec() for layer in layers]
    assert specs[0] == FullAttentionSpec(16, torch.float32, num_kv_heads=2, head_size=16)
    assert specs[1] == specs[2] == SlidingWindowSpec(16, torch.float32, 2, 16, sliding_window=8)
    for layer, spec in zip(layers, specs, strict=True):
        req = BackendRequest(layer=layer.config, device_type="cpu", kv_cache_kind=spec.kind)
        assert DenseSDPABackend.validate(req) == []


def test_sliding_window_rules_across_config_styles() -> None:
    from types import SimpleNamespace as NS

    mistral = NS(sliding_window=4096)
    assert [layer_sliding_window(mistral, i) for i in range(2)] == [4096, 4096]
    old_qwen2 = NS(sliding_window=64, use_sliding_window=True, max_window_layers=1)
    assert [layer_sliding_window(old_qwen2, i) for i in range(3)] == [None, 64, 64]
    assert layer_sliding_window(NS(sliding_window=64, use_sliding_window=False), 0) is None
    typed = NS(sliding_window=32, layer_types=["sliding_attention", "full_attention"])
    assert [layer_sliding_window(typed, i) for i in range(2)] == [32, None]
    assert layer_sliding_window(NS(), 0) is None  # Llama: no sliding_window attribute


def test_stacked_parameters_only(qwen2_sliding: Path) -> None:
    with torch.device("meta"):
        model = Qwen2ForCausalLM(build_context(qwen2_sliding))
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.self_attn.qkv_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj" in n or ".gate_proj" in n for n in names)
