"""The `custom_op` registry kind and the worker's binding step: layers declare ops, a provider that
supports the device/dtype is bound into every declaring layer, nothing is bound unless the platform asks,
and a bound model still computes the same thing (here with recording providers wrapping torch math)."""

from __future__ import annotations

import logging

import pytest
import torch
from keel_platform_cpu.platform import CpuPlatform
from keel_platform_cuda.platform import CudaPlatform
from torch import nn

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.layers.activation import SiluAndMul
from keel.layers.custom_op import CUSTOM_OP_NAMES, CustomOpError, MissingCustomOpError, bind_custom_ops
from keel.layers.fused_moe import FusedMoE, RoutingConfig
from keel.layers.layernorm import RMSNorm
from keel.layers.linear import ReplicatedLinear, RowParallelLinear
from keel.layers.mla_attention import MLAAttention
from keel.layers.rotary import RotaryEmbedding
from keel.layers.token_bitmask import TokenBitmask
from keel.platform import Platform
from keel.plugins.loader import load_plugins
from keel.plugins.manifest import KINDS
from keel.testing.checkpoints import make_checkpoint

# Recording providers: the native math, plus a call log. `supports` only float32 on the CPU.
OPS_SRC = """
import torch
import torch.nn.functional as F

CALLS = []


class _Base:
    def supports(self, device_type, dtype):
        return device_type == "cpu" and dtype == torch.float32


def _norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNormOp(_Base):
    def __call__(self, x, weight, eps):
        CALLS.append("rms_norm")
        return _norm(x, weight, eps)


class FusedAddRMSNormOp(_Base):
    def __call__(self, x, residual, weight, eps):
        CALLS.append("fused_add_rms_norm")
        s = x + residual
        return _norm(s, weight, eps), s


class SiluAndMulOp(_Base):
    def __call__(self, x):
        CALLS.append("silu_and_mul")
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class NoSupports:
    def __call__(self, x):
        return x


class PickyExperts(_Base):
    # takes FusedMoE layers with at most 4 experts only

    def supports_layer(self, layer):
        return layer.num_experts <= 4

    def __call__(self, *args):
        raise AssertionError("not called in these tests")
"""
PROVIDES = {"custom_op": {"rms_norm": "PKG.ops:RMSNormOp", "fused_add_rms_norm": "PKG.ops:FusedAddRMSNormOp",
                          "silu_and_mul": "PKG.ops:SiluAndMulOp"}}


def _ops_plugin(fake_plugins, provides=PROVIDES):
    pkg = fake_plugins("ops-fake", provides=provides, files={"ops.py": OPS_SRC})
    return pkg, load_plugins(["ops-fake"], path=[fake_plugins.path])


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(8)
        self.act = SiluAndMul()
        self.rope = RotaryEmbedding(4, 4, 16, {"rope_type": "default", "rope_theta": 10000.0})
        self.lin = nn.Linear(4, 4)


def test_custom_op_is_a_registry_kind():
    assert "custom_op" in KINDS
    assert set(CUSTOM_OP_NAMES) == {"fused_add_rms_norm", "rms_norm", "rotary_embedding", "mla_rope",
                                    "mla_rope_norm", "silu_and_mul", "linear_small_m", "router_gemm", "select_experts",
                                    "fused_experts", "apply_token_bitmask"}
    assert TokenBitmask.custom_ops == ("apply_token_bitmask",)
    assert RMSNorm.custom_ops == ("rms_norm", "fused_add_rms_norm")
    assert SiluAndMul.custom_ops == ("silu_and_mul",) and RotaryEmbedding.custom_ops == ("rotary_embedding",)
    assert FusedMoE.custom_ops == ("select_experts", "fused_experts")
    assert MLAAttention.custom_ops == ("mla_rope", "mla_rope_norm")
    assert ReplicatedLinear.custom_ops == RowParallelLinear.custom_ops == ("linear_small_m",)


def test_platforms_ask_for_custom_ops_only_on_cuda():
    assert Platform.use_custom_ops(CpuPlatform()) is False and CpuPlatform().use_custom_ops() is False
    assert CudaPlatform().use_custom_ops() is True
    # CUDA cannot serve the torch MoE experts path (host sync per layer, no graph capture)
    assert CpuPlatform().required_custom_ops() == () and CudaPlatform().required_custom_ops() == ("fused_experts",)


def _moe_model() -> nn.Module:
    model = nn.Module()
    model.small = FusedMoE(4, 8, 4, RoutingConfig(num_experts=4, top_k=2))
    model.large = FusedMoE(8, 8, 4, RoutingConfig(num_experts=8, top_k=2))
    model.block = _Block()
    return model


def test_provider_may_decline_single_layers(fake_plugins, caplog):
    _, plugins = _ops_plugin(fake_plugins, {"custom_op": {"fused_experts": "PKG.ops:PickyExperts"}})
    model = _moe_model()
    with caplog.at_level(logging.INFO, logger="keel.custom_op"):
        assert bind_custom_ops(model, plugins.registry("custom_op"), "cpu", torch.float32) == {"fused_experts": 1}
    assert set(model.small.bound_ops) == {"fused_experts"} and not model.large.bound_ops
    assert "declined large" in caplog.text


def test_required_op_left_unbound_stops_binding_with_the_reason(fake_plugins):
    _, plugins = _ops_plugin(fake_plugins, {"custom_op": {"fused_experts": "PKG.ops:PickyExperts"}})
    registry = plugins.registry("custom_op")
    with pytest.raises(MissingCustomOpError, match=r"'fused_experts' is required.*1 layer\(s\) \(large\).*declines"):
        bind_custom_ops(_moe_model(), registry, "cpu", torch.float32, required=("fused_experts",))
    with pytest.raises(MissingCustomOpError, match="does not support cpu/torch.bfloat16"):
        bind_custom_ops(_moe_model(), registry, "cpu", torch.bfloat16, required=("fused_experts",))
    fake_plugins("ops-bare", provides={"custom_op": {}})
    bare = load_plugins(["ops-bare"], path=[fake_plugins.path]).registry("custom_op")  # no MoE op at all
    with pytest.raises(MissingCustomOpError, match="no loaded plugin provides it.*kernels-triton"):
        bind_custom_ops(_moe_model(), bare, "cpu", torch.float32, required=("fused_experts",))
    # a model without MoE layers needs nothing, whatever the platform requires
    assert bind_custom_ops(_Block(), bare, "cpu", torch.float32, required=("fused_experts",)) == {}


def test_bind_binds_supported_ops_into_declaring_layers(fake_plugins, caplog):
    pkg, plugins = _ops_plugin(fake_plugins)
    model = nn.Sequential(_Block(), _Block())
    x, res = torch.randn(3, 8), torch.randn(3, 8)
    want_norm, want_fused = model[0].norm(x), model[0].norm(x, res)
    with caplog.at_level(logging.INFO, logger="keel.custom_op"):
        counts = bind_custom_ops(model, plugins.registry("custom_op"), "cpu", torch.float32)
    assert counts == {"rms_norm": 2, "fused_add_rms_norm": 2, "silu_and_mul": 2}
    assert "ops-fake" in caplog.text and "rms_norm" in caplog.text
    # Not registered: rope keeps its native math, and layers without custom_ops are untouched.
    assert not model[0].rope.bound_ops and not hasattr(model[0].lin, "bound_ops")
    calls = __import__(f"{pkg}.ops", fromlist=["CALLS"]).CALLS
    torch.testing.assert_close(model[0].norm(x), want_norm, rtol=0, atol=0)
    torch.testing.assert_close(model[0].norm(x, res), want_fused, rtol=0, atol=0)
    model[1].act(torch.randn(2, 6))
    assert calls == ["rms_norm", "fused_add_rms_norm", "silu_and_mul"]
    # Bound per instance: a fresh layer still runs torch math.
    assert not RMSNorm(8).bound_ops


def test_unsupported_device_or_dtype_binds_nothing(fake_plugins, caplog):
    _, plugins = _ops_plugin(fake_plugins)
    model = _Block()
    with caplog.at_level(logging.INFO, logger="keel.custom_op"):
        assert bind_custom_ops(model, plugins.registry("custom_op"), "cpu", torch.bfloat16) == {}
        assert bind_custom_ops(model, plugins.registry("custom_op"), "cuda", torch.float32) == {}
    assert not model.norm.bound_ops and not model.act.bound_ops
    assert "does not support" in caplog.text


def test_provider_without_supports_is_a_typed_error(fake_plugins):
    _, plugins = _ops_plugin(fake_plugins, {"custom_op": {"silu_and_mul": "PKG.ops:NoSupports"}})
    with pytest.raises(CustomOpError, match="silu_and_mul.*ops-fake.*supports"):
        bind_custom_ops(_Block(), plugins.registry("custom_op"), "cpu", torch.float32)


def _generate(path, plugins) -> tuple[LLMEngine, list[int]]:
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(path), skip_tokenizer_init=True, dtype="float32", block_size=16, max_model_len=64,
        plugins=plugins, attention_backend="torch_paged",
    ))
    engine.add_request("r", {"prompt_token_ids": [5, 17, 42, 7, 99]},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    out = []
    while engine.has_unfinished_requests():
        out += [list(o.outputs[0].token_ids) for o in engine.step() if o.finished]
    return engine, out[0]


def test_worker_binds_only_when_the_platform_asks(fake_plugins, monkeypatch, tmp_path):
    pkg, _ = _ops_plugin(fake_plugins)
    path = make_checkpoint("llama", tmp_path / "llama", num_hidden_layers=2)
    names = ["platform-cpu", "attention-torch", "models-llama", "ops-fake"]
    engine, native = _generate(path, names)
    model = engine.core.worker.runner.model
    assert not any(getattr(m, "bound_ops", None) for m in model.modules())

    monkeypatch.setattr(CpuPlatform, "use_custom_ops", lambda self: True)
    engine, fused = _generate(path, names)
    norms = [m for m in engine.core.worker.runner.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(set(m.bound_ops) == {"rms_norm", "fused_add_rms_norm"} for m in norms)
    calls = __import__(f"{pkg}.ops", fromlist=["CALLS"]).CALLS
    assert {"rms_norm", "fused_add_rms_norm", "silu_and_mul"} <= set(calls)
    assert fused == native
