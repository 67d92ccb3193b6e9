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
