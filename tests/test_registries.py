import logging

import pytest
import torch

from keel.attention.backend import AttentionLayerConfig, BackendCapabilities, BackendRequest, default_validate
from keel.attention.selector import AttentionBackendError, candidate_order, select_attention_backend
from keel.models.registry import ModelRegistry, UnsupportedArchitectureError
from keel.platform import PlatformError, select_platform
from keel.plugins.errors import PluginLoadError
from keel.plugins.loader import load_plugins

PLATFORMS = """
from keel.platform import Platform


class Npu(Platform):
    name = "npu"
    device_type = "cpu"
    priority = 10

    @classmethod
    def is_available(cls):
        return True

    def attention_backend_preference(self):
        return ["big_heads", "missing_one"]


class Ghost(Platform):
    name = "ghost"
    device_type = "cpu"
    priority = 100

    @classmethod
    def is_available(cls):
        return False
"""

BACKENDS = """
from keel.attention.backend import BackendCapabilities, default_validate


def make(key, caps):
    class B:
        name = key
        capabilities = caps

        @classmethod
        def validate(cls, request):
            return default_validate(cls.capabilities, request)
    return B


BigHeads = make("big_heads", BackendCapabilities(head_sizes=(128,)))
AnyHeads = make("any_heads", BackendCapabilities())
MlaOnly = make("mla_only", BackendCapabilities(supports_mla=True, kv_cache_kinds=("mla_latent",)))
"""


@pytest.fixture
def plugins(fake_plugins):
    fake_plugins("platform-npu", provides={"platform": {"npu": "PKG.p:Npu", "ghost": "PKG.p:Ghost"}},
                 files={"p.py": PLATFORMS})
    fake_plugins("attention-fake", files={"b.py": BACKENDS}, provides={"attention_backend": {
        "any_heads": "PKG.b:AnyHeads", "big_heads": "PKG.b:BigHeads", "mla_only": "PKG.b:MlaOnly"}})
    return load_plugins(["platform-cpu", "platform-npu", "attention-fake"])


def _request(head_size=64, use_mla=False, kind="full_attention"):
    layer = AttentionLayerConfig(num_heads=4, num_kv_heads=2, head_size=head_size, scale=0.125,
                                 dtype=torch.float32, block_size=16, use_mla=use_mla)
    return BackendRequest(layer=layer, device_type="cpu", kv_cache_kind=kind)


def test_platform_auto_picks_highest_available_priority(plugins):
    assert select_platform("auto", plugins).name == "npu"  # ghost has higher priority but is unavailable


def test_platform_named_and_errors(plugins):
    assert select_platform("cpu", plugins).name == "cpu"
    with pytest.raises(PlatformError, match="'ghost'.*not available"):
        select_platform("ghost", plugins)
    with pytest.raises(KeyError, match="did you mean 'npu'"):
        select_platform("npuu", plugins)


def test_platform_auto_with_none_available(fake_plugins):
    fake_plugins("only-ghost", provides={"platform": {"ghost": "PKG.p:Ghost"}}, files={"p.py": PLATFORMS})
    with pytest.raises(PlatformError, match="ghost: not available"):
        select_platform("auto", load_plugins(["only-ghost"]))


def test_platform_import_failure_is_loud_when_named(fake_plugins):
    fake_plugins("platform-bad", provides={"platform": {"bad": "PKG.p:Bad"}},
                 files={"p.py": "raise ImportError('libnpu.so not found')\n"})
    plugins = load_plugins(["platform-cpu", "platform-bad"])
    with pytest.raises(PluginLoadError, match="libnpu.so not found"):
        select_platform("auto", plugins)


def test_attention_auto_follows_preference_and_logs_rejections(plugins, caplog):
    npu = select_platform("npu", plugins)
    assert candidate_order(npu, plugins)[:1] == ["big_heads"]
    with caplog.at_level(logging.INFO, logger="keel.attention"):
        backend = select_attention_backend(npu, _request(head_size=64), "auto", plugins)
    assert backend.name == "any_heads"
    assert "'big_heads' rejected: head size 64 not in (128,)" in caplog.text
    assert "'missing_one'" in caplog.text  # preferred but not loaded
    assert select_attention_backend(npu, _request(head_size=128), "auto", plugins).name == "big_heads"


def test_attention_requested_backend_that_rejects_is_an_error(plugins):
    npu = select_platform("npu", plugins)
    with pytest.raises(AttentionBackendError, match="'big_heads'.*head size 64"):
        select_attention_backend(npu, _request(head_size=64), "big_heads", plugins)
    with pytest.raises(KeyError, match="did you mean 'big_heads'"):
        select_attention_backend(npu, _request(), "big_head", plugins)


def test_attention_none_fits_lists_every_reason(plugins):
    npu = select_platform("npu", plugins)
    with pytest.raises(AttentionBackendError) as err:
        select_attention_backend(npu, _request(kind="state_space"), "auto", plugins)
    msg = str(err.value)
    for key in ("big_heads: head size 64", "any_heads: KV cache kind", "mla_only: KV cache kind"):
        assert key in msg
    mla = select_attention_backend(npu, _request(use_mla=True, kind="mla_latent"), "auto", plugins)
    assert mla.name == "mla_only"


def test_default_validate_reports_reasons():
    caps = BackendCapabilities(dtypes=(torch.float16,), block_sizes=(32,))
    reasons = default_validate(caps, _request())
    assert any("dtype" in r for r in reasons) and any("block size 16" in r for r in reasons)


MODELS = """
from typing import ClassVar


class Gen:
    supports_tensor_parallel: ClassVar[bool] = True

    def forward(self, input_ids, positions, ctx): ...
    def compute_logits(self, hidden): ...
    def load_weights(self, weights): ...


class Embed:
    def pool(self, hidden, query_start_loc): ...


class MoeMtp(Gen):
    packed_modules_mapping: ClassVar[dict] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self):
        raise AssertionError("inspect must not build the model")

    @classmethod
    def get_expert_mapping(cls, hf_config): return []
    def forward_mtp(self, input_ids, positions, hidden, ctx, step=0): ...
"""


def test_model_registry_inspects_without_building(fake_plugins):
    fake_plugins("models-fake", files={"m.py": MODELS}, provides={"model_arch": {
        "GenForCausalLM": "PKG.m:Gen", "EmbedModel": "PKG.m:Embed", "MoeMtpForCausalLM": "PKG.m:MoeMtp"}})
    registry = ModelRegistry(load_plugins(["models-fake"]))
    assert registry.get_supported_archs() == ["EmbedModel", "GenForCausalLM", "MoeMtpForCausalLM"]
    gen = registry.inspect_model_cls(["GenForCausalLM"])
    assert gen.is_text_generation_model and gen.supports_tensor_parallel and not gen.is_pooling_model
    assert registry.inspect_model_cls("EmbedModel").capabilities == frozenset({"pooling"})
    moe = registry.inspect_model_cls(["Unknown", "MoeMtpForCausalLM"])
    assert moe.architecture == "MoeMtpForCausalLM"
    assert moe.capabilities == {"text_generation", "tensor_parallel", "moe", "mtp", "quantization"}
    assert "models-fake" in moe.provider
    with pytest.raises(UnsupportedArchitectureError, match="did you mean 'GenForCausalLM'"):
        registry.resolve_model_cls(["GenForCausalLm"])


def test_kv_cache_spec_kind_registry():
    registry = load_plugins([]).registry("kv_cache_spec")
    assert registry.ref("mla_latent") == "keel.kv_cache.single_type:FullAttentionManager"
    assert registry.provider("sliding_window").plugin == "core"
    from keel.kv_cache.spec import FullAttentionSpec, MLALatentSpec, SlidingWindowSpec

    for spec in (FullAttentionSpec, SlidingWindowSpec, MLALatentSpec):
        assert spec.kind in registry
