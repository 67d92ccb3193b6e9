"""A Llama model's declared input producers (`set_input_producer`) take over its fp8 W8A8 layers' activation
quantization after loading (`keel.layers.input_quant`): the whole model's prefill logits equal the unfused model's
bit for bit. The fp8 GEMMs and the fused kernels run interpreted on the CPU (the layers' GPU paths forced)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported (triton.jit reads it then)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from keel_models_llama.llama import LlamaForCausalLM
from llama_test_utils import build_context, prefill_logits, random_prompts

from keel.layers.input_quant import QuantizedInput, bind_input_quant
from keel.layers.layernorm import RMSNorm
from keel.models.interface import ModelBuildContext
from keel.models.loader import load_model
from keel.testing.checkpoints import make_checkpoint

pytest.importorskip("triton")
quantization = pytest.importorskip("keel_quantization.quantizer")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU's own paths are tests/test_cuda_quant.py's")
@pytest.mark.parametrize("layout", ["fp8-channel", "fp8-block"])  # per-token scales; per token and 16-input group
def test_fused_producers_give_the_unfused_models_logits(tmp_path, monkeypatch, layout):
    from keel_kernels_triton.ops import TritonFusedAddRMSNorm, TritonRMSNorm, TritonSiluAndMul
    from keel_quantization.fp8 import Fp8Config

    from keel.layers.activation import SiluAndMul

    src = make_checkpoint("llama", tmp_path / "src")
    path = quantization.quantize_checkpoint(src, tmp_path / "q", layout, block=(16, 16))
    ctx = build_context(path)
    quant = Fp8Config.from_config(ctx.hf_config.quantization_config)
    model = load_model(LlamaForCausalLM, ModelBuildContext(**{**ctx.__dict__, "quant_method": quant}), path)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.input_producer == (layer.input_layernorm,)
    assert layer.mlp.gate_up_proj.input_producer == (layer.post_attention_layernorm,)
    assert layer.mlp.down_proj.input_producer == (layer.mlp.act_fn,)
    assert layer.input_layernorm.fused_input_quant is None  # CPU weights: the reference path, nothing fused
    for module in model.modules():  # the layers' GPU paths, and the unfused kernels the fused ones reproduce
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.native, method.small_m_max_m, method.small_m = "triton", 4, "w8a8_small_m"
        if isinstance(module, RMSNorm):
            module.bound_ops = {"rms_norm": TritonRMSNorm(), "fused_add_rms_norm": TritonFusedAddRMSNorm()}
        if isinstance(module, SiluAndMul):
            module.bound_ops = {"silu_and_mul": TritonSiluAndMul()}
    prompts = random_prompts(300, [3, 6])  # 9 tokens: past the small-M bound of 4
    want = prefill_logits(model, prompts)
    assert bind_input_quant(model) == 3 * len(model.model.layers)  # two norms and the activation per layer
    took = []
    apply = type(layer.self_attn.qkv_proj.quant_method).apply
    def spy(self, mod, x, bias=None):
        took.append(isinstance(x, QuantizedInput))
        return apply(self, mod, x, bias)

    monkeypatch.setattr(type(layer.self_attn.qkv_proj.quant_method), "apply", spy)
    got = prefill_logits(model, prompts)
    assert torch.equal(got, want)
    assert took.count(True) == 3 * len(model.model.layers) and took.count(False) == len(model.model.layers)  # o_proj
