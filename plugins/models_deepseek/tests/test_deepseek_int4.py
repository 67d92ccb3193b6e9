"""A tiny DeepSeek-V3 in GPTQ and AWQ 4-bit layouts (keel's quantizer; routed experts included): the
experts stay packed int4 in memory and the engine matches transformers on the dequantized weights.
Weight-only, so tight: logprobs within 1e-4, greedy tokens equal where the top-2 margin exceeds 0.5; through
chunked prefill, preemption and prefix hits."""

from __future__ import annotations

import pytest
import torch
from deepseek_test_utils import make_deepseek_checkpoint, random_prompts
from safetensors.torch import load_file, save_file

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.fidelity import assert_close_to_hf, run_requests

quantizer = pytest.importorskip("keel_quantization.quantizer")

CASES = {
    "gptq-g32-asym-desc-act": ("gptq", {"group_size": 32, "sym": False, "desc_act": True}),
    "awq-g32": ("awq", {"group_size": 32, "sym": False}),
}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    src = make_deepseek_checkpoint(3, tmp_path_factory.mktemp("dsv3int4") / "src")
    file = src / "model.safetensors"
    w = load_file(str(file))
    w["lm_head.weight"] = w["lm_head.weight"] * 6  # clear greedy margins
    save_file(w, str(file), metadata={"format": "pt"})
    return src


def make_engine(path, **kw):
    args = {"model": str(path), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 4,
            "max_model_len": 64, "seed": 0, **kw}
    return LLMEngine.from_engine_args(EngineArgs(**args))


@pytest.mark.parametrize("case", list(CASES))
def test_int4_deepseek_v3_experts_stay_packed_and_match_transformers(source, tmp_path, case):
    layout, options = CASES[case]
    q = quantizer.quantize_checkpoint(source, tmp_path / "q", layout, dequantized_to=tmp_path / "ref", **options)
    ref = tmp_path / "ref"
    engine = make_engine(q)
    experts = engine.core.worker.runner.model.model.layers[1].mlp.experts
    assert experts.w13_qweight.dtype == torch.int32 and experts.w13_qweight.shape == (8, 64 // 8, 2 * 32)
    assert experts.w2_qweight.shape == (8, 32 // 8, 64) and not hasattr(experts, "w13_weight")
    prompts = random_prompts([7, 15, 10], seed=3)
    stats = assert_close_to_hf(ref, prompts, run_requests(engine, prompts, GREEDY), atol=1e-4, min_margin=0.5)
    assert stats["near_ties"] < 9

    shared = random_prompts([16], seed=4)[0]
    stressed_prompts = [shared + p for p in random_prompts([3, 7, 2, 9], seed=5)]
    engine = make_engine(q, max_num_batched_tokens=8, num_kv_blocks=9, max_model_len=32)
    stressed = run_requests(engine, stressed_prompts, GREEDY, stagger=1)
    m = engine.get_metrics()
    assert m["num_preemptions_total"] > 0 and m["prefix_cache_hits_total"] > 0, {k: v for k, v in m.items() if "total" in k}
    assert_close_to_hf(ref, stressed_prompts, stressed, atol=1e-4, min_margin=0.5)


def test_dummy_gptq_experts(source, tmp_path):
    """load_format="dummy" with a GPTQ config: the packed experts get valid words and group ids."""
    import json
    import math
    import shutil

    path = tmp_path / "dummy"
    shutil.copytree(source, path)
    cfg = json.loads((path / "config.json").read_text())
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}))
    engine = make_engine(path, load_format="dummy")
    experts = engine.core.worker.runner.model.model.layers[1].mlp.experts
    assert int(experts.w2_g_idx.max()) == experts.w2_scales.shape[1] - 1
    out = run_requests(engine, [[5, 6, 7, 8]], GREEDY)["0"].outputs[0]
    assert all(math.isfinite(d[t].logprob) for d, t in zip(out.logprobs, out.token_ids))
