"""DeepSeek's declared input producers (input_layernorm -> q_a_proj and kv_a_proj_with_mqa, sharing one quantized
input; q_a_layernorm -> q_b_proj; the dense layers' post-attention norm -> gate_up; each SwiGLU MLP's activation ->
down, shared experts included) take over the block-fp8 layers'
per-token-group activation quantization after loading (`keel.layers.input_quant`): the model's prefill logits
equal the unfused model's bit for bit. The fp8 GEMMs and the fused kernels run interpreted on the CPU (the
layers' Triton path forced); the MoE experts keep their reference path."""

from __future__ import annotations

import pytest
import torch
from deepseek_test_utils import build_context, make_deepseek_checkpoint, prefill_logits, random_prompts 

from keel.layers.activation import SiluAndMul 
from keel.layers.input_quant import bind_input_quant 
from keel.layers.layernorm import RMSNorm 
from keel.models.interface import ModelBuildContext 
from keel.models.loader import load_model 

pytest.importorskip("triton")
quantizer = pytest.importorskip("keel_quantization.quantizer")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU's own paths are tests/test_cuda_quant.py's")
def test_fused_producers_give_the_unfused_models_logits(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # this directory's conftest turns it off per test
    from keel_kernels_triton.ops import TritonFusedAddRMSNorm, TritonRMSNorm, TritonSiluAndMul
    from keel_models_deepseek.deepseek_v3 import DeepseekV3ForCausalLM
    from keel_quantization.fp8 import Fp8Config

    src = make_deepseek_checkpoint(3, tmp_path / "src", q_lora_rank=32)
    path = quantizer.quantize_checkpoint(src, tmp_path / "q", "fp8-block", block=(16, 16))
    ctx = build_context(path)
    quant = Fp8Config.from_config(ctx.hf_config.quantization_config)
    model = load_model(DeepseekV3ForCausalLM, ModelBuildContext(**{**ctx.__dict__, "quant_method": quant}), path)
    dense, moe = model.model.layers[0], model.model.layers[1]
    assert dense.self_attn.q_b_proj.input_producer == (dense.self_attn.q_a_layernorm,)
    assert dense.mlp.gate_up_proj.input_producer == (dense.post_attention_layernorm,)
    assert dense.mlp.down_proj.input_producer == (dense.mlp.act_fn,)
    for module in model.modules():  # the layers' GPU paths, and the unfused kernels the fused ones reproduce
        method = getattr(module, "quant_method", None)
        if hasattr(method, "small_m_max_m"):
            method.native, method.small_m_max_m, method.small_m = "triton", 4, "w8a8_small_m"
        if isinstance(module, RMSNorm):
            module.bound_ops = {"rms_norm": TritonRMSNorm(), "fused_add_rms_norm": TritonFusedAddRMSNorm()}
        if isinstance(module, SiluAndMul):
            module.bound_ops = {"silu_and_mul": TritonSiluAndMul()}
    prompts = random_prompts([3, 6], seed=5)  # 9 tokens: past the small-M bound of 4
    want = prefill_logits(model, prompts)
    bound = bind_input_quant(model)
    assert bound >= 4 and dense.self_attn.q_a_layernorm.fused_input_quant is not None
    assert moe.input_layernorm.fused_input_quant is not None  # one quantized input for q_a and kv_a
    assert moe.self_attn.kv_a_proj_with_mqa.input_producer == (moe.input_layernorm,)
    assert moe.post_attention_layernorm.fused_input_quant is None  # the MoE's router reads it too
    got = prefill_logits(model, prompts)
    assert torch.equal(got, want)
