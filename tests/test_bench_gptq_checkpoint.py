"""benchmarks/h200_vs_vllm.py's GPTQ checkpoint (random codes in GPTQ's 4-bit g128 layout, which keel and vLLM
both load, so the two run GPTQ kernels on the same bytes): a tiny Llama written with its tensors loads in
keel, decodes to weights of the intended scale and serves."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

# not imported here: the quantization plugin's Triton helpers bind to the interpreter mode of their first import,
# which the plugin tests' conftest sets after this module is collected
pytestmark = pytest.mark.skipif(importlib.util.find_spec("keel_quantization") is None,
                                reason="needs the quantization plugin")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import h200_vs_vllm as vs  # noqa: E402

TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, rope_theta=10000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("layout", ["gptq", "gptq-act"])
def test_gptq_checkpoint_loads_and_serves_in_keel(tmp_path, monkeypatch, layout):
    monkeypatch.setattr(vs, "LLAMA3_8B", TINY)
    vs.write_config(tmp_path, "llama8b", layout)
    gen = torch.Generator().manual_seed(0)
    tensors, g_idx_of = {}, {}
    for name, shape in vs.hub_tensors_llama(TINY):  # write_checkpoint's tensors, drawn on the CPU
        tensors.update(vs.checkpoint_tensors(name, shape, gen, layout, g_idx_of))
    q = "model.layers.0.self_attn.q_proj"
    assert tensors[f"{q}.qweight"].shape == (256 // 8, 256) and tensors[f"{q}.scales"].shape == (2, 256)
    assert tensors["model.layers.0.mlp.down_proj.qzeros"].shape == (4, 256 // 8)
    # projections reading the same activations share one g_idx, as GPTQ's activation order gives them (keel
    # refuses a fused layer whose shards differ); act order shuffles each input's group
    for shards in (("q", "k", "v"), ("gate", "up")):
        part = "self_attn" if shards[0] == "q" else "mlp"
        g = [tensors[f"model.layers.1.{part}.{s}_proj.g_idx"] for s in shards]
        assert all(torch.equal(g[0], x) for x in g[1:])
        assert (layout == "gptq-act") == (not torch.equal(g[0], torch.arange(256, dtype=torch.int32) // 128))
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    qcfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "gptq" and qcfg["desc_act"] == (layout == "gptq-act")
    g_idx = tensors["model.layers.0.mlp.down_proj.g_idx"]  # K 512: four groups of 128
    assert sorted(g_idx.tolist()) == [0] * 128 + [1] * 128 + [2] * 128 + [3] * 128
    assert (layout == "gptq-act") == (not torch.equal(g_idx, torch.arange(512, dtype=torch.int32) // 128))

    from keel import LLM, SamplingParams

    llm = LLM(model=str(tmp_path), profile="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=64,
              max_num_seqs=2, seed=0)
    assert vs.applied_quantization(llm, "keel") == "gptq"
    layer = llm.llm_engine.core.worker.runner.model.model.layers[0]
    qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj
    # act order is put in group order once after loading, so the in-order kernels serve it; the layer gathers its
    # activations, except down_proj, whose permutation went into gate_up's outputs (set_input_source)
    assert (qkv.input_perm is not None) == (layout == "gptq-act") and down.input_perm is None
    assert down.quant_method.group_in_order == 128
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=4, temperature=0,
                                                                             ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    # the codes decode (the quantization plugin's own unpacking; zeros stored minus one) around zero point 8
    # at ~1/sqrt(K): weights of keel's dummy-init scale
    from keel_quantization import int4_math

    zeros = int4_math.unpack_cols(tensors[f"{q}.qzeros"]) + 1
    assert bool((zeros == 8).all())
    w = int4_math.dequantize_int4(int4_math.unpack_rows(tensors[f"{q}.qweight"]), zeros, tensors[f"{q}.scales"],
                                  tensors[f"{q}.g_idx"], torch.float32)
    assert abs(w.std().item() * 256**0.5 - 1) < 0.2 and abs(w.mean().item()) < 0.01
    llm.shutdown()


def test_top2_rows_and_the_divergence_report(tmp_path, monkeypatch):
    """The side-by-side's near-tie evidence: top-2 logprobs per greedy position from keel's (vLLM-shaped)
    output, and the first position two engines part with each one's top-1 minus top-2 gap there."""
    monkeypatch.setattr(vs, "LLAMA3_8B", TINY)
    vs.write_config(tmp_path, "llama8b", None)
    from keel import LLM, SamplingParams

    llm = LLM(model=str(tmp_path), profile="cpu", dtype="float32", load_format="dummy", skip_tokenizer_init=True,
              max_model_len=64, max_num_seqs=2, seed=0)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=3, temperature=0,
                                                                             ignore_eos=True, logprobs=2))
    rows = vs.top2(out[0].outputs[0])
    assert len(rows) == 3 and all(r[0] == t for r, t in zip(rows, out[0].outputs[0].token_ids))
    assert all(r[1] >= r[3] and r[2] != r[0] for r in rows)  # greedy: the token is the best, the runner-up another
    a = {"top2": [[[1, -0.5, 2, -0.9], [3, -0.1, 4, -0.1002]], [[1, -0.5, 2, -0.9]]]}
    b = {"top2": [[[1, -0.5, 2, -0.9], [4, -0.1001, 3, -0.1003]], [[1, -0.5, 2, -0.9]]]}
    assert vs.divergence(a, b) == [{"first_difference": 1, "gap_a": 0.0002, "gap_b": 0.0002},
                                   {"first_difference": None, "gap_a": None, "gap_b": None}]


TINY_DSV2 = dict(vocab_size=300, hidden_size=128, intermediate_size=96, moe_intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=None,
                 qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256,
                 rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, topk_method="greedy",
                 n_group=1, topk_group=1, norm_topk_prob=False)


def test_block_fp8_deepseek_checkpoint_loads_and_serves_in_keel(tmp_path, monkeypatch):
    """The DSV2-Lite block-fp8 checkpoint both engines load (same weights, so the same routing): projections in
    DeepSeek-V3's layout from keel's quantizer, the router and the dense first layer's MLP (not a multiple of the
    128-row block) in bf16 and named in ignored_layers."""
    monkeypatch.setattr(vs, "DSV2_LITE", TINY_DSV2)
    vs.write_config(tmp_path, "dsv2lite", "fp8-block")
    qcfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qcfg["weight_block_size"] == [128, 128]
    # named module by module: vLLM matches ignored_layers by exact name ("model.layers.0.mlp" left it quantizing
    # that down_proj, and asserting on its 96-wide input here, 10944 in DSV2-Lite)
    assert qcfg["ignored_layers"] == [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    gen, tensors = torch.Generator().manual_seed(0), {}
    for name, shape in vs.hub_tensors_dsv2(TINY_DSV2):  # write_checkpoint's tensors, drawn on the CPU
        tensors.update(vs.checkpoint_tensors(name, shape, gen, "fp8-block", {}, tuple(qcfg["ignored_layers"])))
    w = "model.layers.1.mlp.experts.3.down_proj"
    assert tensors[f"{w}.weight"].dtype == torch.float8_e4m3fn and tensors[f"{w}.weight_scale_inv"].shape == (1, 1)
    assert tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (1, 1)  # 72 rows
    for bf16 in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.gate.weight", "lm_head.weight"):
        assert tensors[bf16].dtype == torch.bfloat16 and bf16.removesuffix("weight") + "weight_scale_inv" not in tensors
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    from keel import LLM, SamplingParams

    llm = LLM(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True, max_model_len=64, max_num_seqs=2,
              seed=0)  # the default profile (every plugin; the suite pins the platform): the DeepSeek plugin
    assert vs.applied_quantization(llm, "keel") == "fp8"
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=4, temperature=0,
                                                                             ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    # the reference the device run reads both engines against: transformers on the dequantized weights
    ps = [[5, 6, 7, 8, 9, 10], [40, 41, 3, 77]]
    lp = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(max_tokens=4, temperature=0,
                                                                           ignore_eos=True, logprobs=2))
    llm.shutdown()
    ref = vs.reference_rows(str(tmp_path), ps, steps=4)
    assert ref["dtype"] == "float32" and ref["quantization_applied"] == "fp8, dequantized"
    gaps = vs.reference_gap({"top2": [vs.top2(o.outputs[0]) for o in lp]}, ref)
    # activations quantized per 128-group: test_deepseek_fp8.py's tolerance (logprobs within 0.6, greedy tokens
    # equal where the reference's top-2 margin is over 0.5)
    assert all(g["first_difference"] is None or g["reference_gap"] < 0.5 for g in gaps), gaps
    assert all(g["max_logprob_diff"] < 0.6 for g in gaps), gaps
