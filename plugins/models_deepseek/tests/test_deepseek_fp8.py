"""A tiny DeepSeek-V3 checkpoint in the released block-FP8 layout (keel's quantizer): every projection of
the decoder layers and of the MTP layer in e4m3 with `weight_scale_inv` blocks, MLA's kv_a_proj_with_mqa
with a partial last block (40 rows in 16-row blocks, as 576 in 128), kv_b_proj quantized too; router,
embeddings, heads and eh_proj unquantized, as in the release. It loads and serves, with MTP drafting,
close to transformers on the dequantized weights (dynamic per-token-group activations: logprobs within
0.6 on this sharpened model, greedy tokens equal where the top-2 margin exceeds 0.5). The routed
experts stay block FP8 in memory (the fused-MoE reference path on the CPU dequantizes only the experts
with work, per step).
"""

from __future__ import annotations

import pytest
import torch
from deepseek_test_utils import make_mtp_checkpoint, random_prompts
from safetensors.torch import load_file, save_file

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.fidelity import assert_close_to_hf, run_requests

quantizer = pytest.importorskip("keel_quantization.quantizer")

BLOCK = (16, 16)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv3fp8")
    src = make_mtp_checkpoint(root / "src", q_lora_rank=32)
    file = src / "model.safetensors"
    w = load_file(str(file))
    w["lm_head.weight"] = w["lm_head.weight"] * 6  # clear greedy margins (see the fp8 engine tests)
    save_file(w, str(file), metadata={"format": "pt"})
    q = quantizer.quantize_checkpoint(src, root / "fp8", "fp8-block", block=BLOCK, dequantized_to=root / "ref")
    return q, root / "ref"


def make_engine(path, **kw):
    args = {"model": str(path), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 4,
            "max_model_len": 96, "seed": 0, **kw}
    return LLMEngine.from_engine_args(EngineArgs(**args))


def test_layout_is_the_released_one(checkpoints):
    q, _ = checkpoints
    w = load_file(str(q / "model.safetensors"))
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa"
    assert w[f"{kv_a}.weight"].dtype == torch.float8_e4m3fn and w[f"{kv_a}.weight"].shape == (40, 64)
    assert w[f"{kv_a}.weight_scale_inv"].shape == (3, 4)  # ceil(40 / 16) row blocks
    for name in ("model.layers.1.mlp.experts.3.gate_proj", "model.layers.2.self_attn.kv_b_proj",
                 "model.layers.2.mlp.shared_experts.down_proj", "model.layers.0.self_attn.q_a_proj"):
        assert w[f"{name}.weight"].dtype == torch.float8_e4m3fn and f"{name}.weight_scale_inv" in w
    for name in ("model.layers.2.eh_proj", "model.layers.1.mlp.gate", "lm_head", "model.layers.2.shared_head.head"):
        assert w[f"{name}.weight"].dtype == torch.float32 and f"{name}.weight_scale_inv" not in w


def test_block_fp8_deepseek_v3_serves_close_to_transformers(checkpoints):
    q, ref = checkpoints
    engine = make_engine(q, speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                         max_num_batched_tokens=16)
    model = engine.core.worker.runner.model
    experts = model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn and experts.w2_weight.dtype == torch.float8_e4m3fn
    assert experts.w13_weight_scale_inv.shape == (8, 2 * 32 // 16, 64 // 16)
    attn = model.model.layers[0].self_attn
    assert attn.kv_a_proj_with_mqa.weight.dtype == torch.float8_e4m3fn
    assert attn.kv_b_proj.quant_method is not None  # MLA absorbed its dequantized weight
    mtp = engine.core.worker.runner.proposer.layer
    assert mtp.self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    prompts = random_prompts([7, 21, 12], seed=5)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    results = run_requests(engine, prompts, params, stagger=1)
    m = engine.get_metrics()
    assert 0 < m["spec_decode_num_accepted_tokens_total"] <= m["spec_decode_num_draft_tokens_total"]
    stats = assert_close_to_hf(ref, prompts, results, atol=0.6, min_margin=0.5)
    assert stats["near_ties"] < 12
    print(f"block-FP8 DeepSeek-V3 vs transformers on dequantized weights: {stats}")


def test_block_fp8_deepseek_v3_with_an_fp8_latent_cache(checkpoints):
    q, ref = checkpoints
    engine = make_engine(q, kv_cache_dtype="fp8", speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    runner = engine.core.worker.runner
    assert all(c.dtype == torch.float8_e4m3fn for c in runner.kv_caches)  # the MTP layer's latent cache too
    prompts = random_prompts([9, 18], seed=6)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    stats = assert_close_to_hf(ref, prompts, run_requests(engine, prompts, params), atol=0.6, min_margin=0.5)
    print(f"block-FP8 DeepSeek-V3, fp8 latent cache, vs transformers on dequantized weights: {stats}")
