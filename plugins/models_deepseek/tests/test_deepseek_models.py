"""DeepSeek-V2/V3 logits match transformers on tiny random checkpoints (float32, torch_mla backend).

One varlen prefill step over paged latent caches, compared with transformers' eager forward at every
token. Cases cover MLA with and without q_lora_rank, DeepSeek YaRN (mscale != mscale_all_dim), both
rope layouts, V2 greedy and group-limited softmax routing, V3 sigmoid + bias group-limited routing
with and without top-k normalization, routed scaling, dense first layers and shared experts.
"""

from __future__ import annotations

import pytest
import torch
from deepseek_test_utils import (
    DEEPSEEK_YARN,
    build_context,
    hf_logits,
    load_keel,
    make_deepseek_checkpoint,
    prefill_logits,
    random_prompts,
)
from keel_models_deepseek import manifest
from keel_models_deepseek.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV2MoE, is_moe_layer
from keel_models_deepseek.deepseek_v3 import DeepseekV3ForCausalLM
from keel_models_deepseek.moe import shared_experts_fusion

from keel.kv_cache.spec import MLALatentSpec
from keel.models.capabilities import model_capabilities
from keel.models.loader import load_model
from keel.models.weights import WeightLoadError
from keel.plugins.loader import load_plugins

CASES = {
    "v2-greedy-no-qlora": (2, {"n_shared_experts": 2}),  # two fused shared experts, as DeepSeek-V2-Lite
    "v2-qlora-yarn-grouped": (
        2,
        {"q_lora_rank": 48, "rope_parameters": DEEPSEEK_YARN, "topk_method": "group_limited_greedy",
         "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.0, "num_hidden_layers": 3},
    ),
    "v3-qlora-yarn": (3, {"q_lora_rank": 48, "rope_parameters": DEEPSEEK_YARN, "routed_scaling_factor": 2.5}),
    "v3-neox-rope-unnormalized": (3, {"rope_interleave": False, "norm_topk_prob": False, "attention_bias": True}),
}
CLASSES = {2: DeepseekV2ForCausalLM, 3: DeepseekV3ForCausalLM}


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_transformers(case, tmp_path):
    version, overrides = CASES[case]
    path = make_deepseek_checkpoint(version, tmp_path / case, **overrides)
    prompts = random_prompts([5, 23, 1, 40])
    model = load_keel(CLASSES[version], path)
    ours = prefill_logits(model, prompts)
    ref = hf_logits(path, prompts)
    assert ours.shape == ref.shape == (69, 300)
    assert ref.abs().max() > 1.0  # O(1) logits: the tolerance below means something
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_tolerance_catches_a_wrong_rope_layout(tmp_path):
    """Guard on the test itself: treating the interleaved rope dims as neox halves must fail."""
    path = make_deepseek_checkpoint(3, tmp_path / "v3")
    prompts = random_prompts([30])
    model = load_keel(DeepseekV3ForCausalLM, path)
    for layer in model.model.layers:
        layer.self_attn.mla_attn.rope_interleaved = False
    assert (prefill_logits(model, prompts) - hf_logits(path, prompts)).abs().max() > 1e-2


def test_structure_kv_spec_and_moe_layers(tmp_path):
    path = make_deepseek_checkpoint(3, tmp_path / "v3", num_hidden_layers=3, q_lora_rank=48)
    model = load_keel(DeepseekV3ForCausalLM, path)
    specs = {layer.kv_cache_spec() for layer in model.attention_layers()}
    assert specs == {MLALatentSpec(4, torch.float32, kv_lora_rank=32, qk_rope_head_dim=8)}
    assert next(iter(specs)).page_size_bytes == 4 * 40 * 4  # one latent per token, no heads
    assert [isinstance(layer.mlp, DeepseekV2MoE) for layer in model.model.layers] == [False, True, True]
    assert len(model.moe_layers()) == 2
    assert model.model.layers[1].mlp.gate.e_score_correction_bias is not None
    cfg = model.config
    assert [is_moe_layer(cfg, i) for i in range(3)] == [False, True, True]


def _checkpoint_tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_strict_loading_names_missing_expert(tmp_path):
    path = make_deepseek_checkpoint(2, tmp_path / "v2")
    tensors = _checkpoint_tensors(path)
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    model = DeepseekV2ForCausalLM(build_context(path))
    loaded = model.load_weights(tensors.items())
    missing = {n for n, _ in model.named_parameters()} - loaded
    assert missing == {"model.layers.1.mlp.experts.w13_weight"}
    tensors = _checkpoint_tensors(path)
    tensors["model.layers.1.mlp.experts.99.up_proj.weight"] = torch.zeros(32, 64)
    with pytest.raises(WeightLoadError, match="experts.99"):
        DeepseekV2ForCausalLM(build_context(path)).load_weights(tensors.items())


def test_mtp_layers_in_checkpoint_are_skipped(tmp_path):
    path = make_deepseek_checkpoint(3, tmp_path / "v3")
    tensors = _checkpoint_tensors(path)
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)  # a V3 MTP module (layer index 2)
    tensors["model.layers.2.self_attn.kv_b_proj.weight"] = torch.zeros(128, 32)
    model = DeepseekV3ForCausalLM(build_context(path))
    loaded = model.load_weights(tensors.items())
    assert loaded == {n for n, _ in model.named_parameters()}


def test_plugin_registers_both_architectures(tmp_path):
    provides = dict(manifest().provides["model_arch"])
    assert set(provides) == {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"}
    registry = load_plugins("auto").registry("model_arch")
    assert registry.get("DeepseekV2ForCausalLM") is DeepseekV2ForCausalLM
    assert registry.get("DeepseekV3ForCausalLM") is DeepseekV3ForCausalLM


def test_model_built_by_loader_is_loaded_and_ready(tmp_path):
    path = make_deepseek_checkpoint(2, tmp_path / "v2", tie_word_embeddings=True)
    model = load_model(DeepseekV2ForCausalLM, build_context(path), path)
    assert model.lm_head is model.model.embed_tokens
    impl = model.attention_layers()[0].impl
    kv_b = model.model.layers[0].self_attn.kv_b_proj.weight.view(4, 32, 32)
    assert torch.equal(impl.w_uk, kv_b[:, :16]) and torch.equal(impl.w_uv, kv_b[:, 16:])


def test_capabilities_report_moe(tmp_path):
    from deepseek_test_utils import tiny_deepseek_config

    for cls in (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM):
        assert {"text_generation", "moe"} <= model_capabilities(cls)
        assert "mtp" not in model_capabilities(cls)
    rows = DeepseekV3ForCausalLM.get_expert_mapping(tiny_deepseek_config(3))
    assert len(rows) == 8 * 3
    assert (".experts.w13_", ".experts.5.up_proj.", 5, "w3") in rows


def test_bfloat16_error_is_no_worse_than_transformers_own(tmp_path):
    path = make_deepseek_checkpoint(3, tmp_path / "v3", q_lora_rank=48, rope_parameters=DEEPSEEK_YARN)
    prompts = random_prompts([5, 23, 40])
    exact = hf_logits(path, prompts)
    hf_err = (hf_logits(path, prompts, torch.bfloat16) - exact).abs().mean()
    model = load_keel(DeepseekV3ForCausalLM, path, torch.bfloat16)
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # routing stays float32
    ours = prefill_logits(model, prompts)
    assert torch.isfinite(ours).all()
    assert (ours - exact).abs().mean() < 2 * hf_err


def test_shared_experts_fusion_is_decided_at_build_and_logged(tmp_path, caplog):
    import dataclasses

    path = make_deepseek_checkpoint(2, tmp_path / "v2", n_shared_experts=2)
    with caplog.at_level("INFO", logger="keel.models.deepseek"):
        model = load_keel(DeepseekV2ForCausalLM, path)
    assert "shared experts: fused" in caplog.text
    moe = model.model.layers[1].mlp
    cfg_top_k = model.config.num_experts_per_tok
    assert moe.shared_experts is None and moe.experts.num_fused_shared_experts == 2
    assert moe.experts.w13_weight.shape[0] == 8 + 2 and moe.experts.routing.num_routes == cfg_top_k + 2
    build = build_context(path)
    cfg = build.hf_config
    assert shared_experts_fusion(cfg, build).num_fused == 2
    for kept in (dataclasses.replace(build, enable_expert_parallel=True, tp_size=2),
                 dataclasses.replace(build, dp_size=2), dataclasses.replace(build, quant_method=object())):
        assert shared_experts_fusion(cfg, kept).num_fused == 0
    cfg.n_shared_experts = 0
    assert "no shared experts" in shared_experts_fusion(cfg, build).reason


def test_qkv_a_fusion_is_decided_at_build_and_logged(tmp_path, caplog):
    """Unquantized, the q (or q_a) and kv_a projections are one GEMM where both are whole on every rank
    and alike in bias (the fidelity cases above run both layouts: v2-greedy-no-qlora and the q_lora cases
    fused, v3-neox-rope-unnormalized -- attention_bias without q_lora -- separate)."""
    import dataclasses

    from keel_models_deepseek.attention import fuse_qkv_a

    path = make_deepseek_checkpoint(2, tmp_path / "v2")
    with caplog.at_level("INFO", logger="keel.models.deepseek"):
        model = load_keel(DeepseekV2ForCausalLM, path)
    assert "q and kv_a projections fused" in caplog.text
    attn = model.model.layers[0].self_attn
    assert attn.fused_qkv_a_proj is not None and not hasattr(attn, "q_proj")
    cfg = model.config
    assert attn.fused_qkv_a_proj.weight.shape == (
        cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
        + cfg.qk_rope_head_dim, cfg.hidden_size)
    build = build_context(path)
    assert fuse_qkv_a(cfg, build)
    assert not fuse_qkv_a(cfg, dataclasses.replace(build, tp_size=2))  # q_proj split over ranks
    assert not fuse_qkv_a(cfg, dataclasses.replace(build, quant_method=object()))
    cfg.attention_bias = True  # HF's q_proj has no bias, kv_a has one
    assert not fuse_qkv_a(cfg, build)
    cfg.q_lora_rank = 48  # q_a and kv_a: replicated, both biased
    assert fuse_qkv_a(cfg, dataclasses.replace(build, tp_size=2))
