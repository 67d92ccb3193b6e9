"""Logits of keel's Llama-family models match transformers on tiny random checkpoints (float32)."""

from __future__ import annotations

import pytest
import torch
from keel_models_llama.llama import LlamaForCausalLM
from keel_models_llama.mistral import MistralForCausalLM
from keel_models_llama.qwen2 import Qwen2ForCausalLM
from keel_models_llama.qwen3 import Qwen3ForCausalLM
from llama_test_utils import hf_logits, load_keel, prefill_logits, random_prompts

from keel.testing.checkpoints import make_checkpoint

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CASES = {
    "llama3-gqa-tied": (
        "llama",
        LlamaForCausalLM,
        {"rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": True},
    ),
    "llama-mqa-bias-linear": (
        "llama",
        LlamaForCausalLM,
        {
            "num_key_value_heads": 1,
            "attention_bias": True,
            "mlp_bias": True,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
    ),
    "llama-yarn": (
        "llama",
        LlamaForCausalLM,
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    ),
    "mistral-sliding": ("mistral", MistralForCausalLM, {"sliding_window": 8}),
    "qwen2": ("qwen2", Qwen2ForCausalLM, {"rope_theta": 1000000.0}),
    "qwen2-sliding-upper-layers": (
        "qwen2",
        Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "qwen3-tied": ("qwen3", Qwen3ForCausalLM, {"tie_word_embeddings": True}),
    "qwen3-wide-heads": ("qwen3", Qwen3ForCausalLM, {"head_dim": 32}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_transformers(case: str, tmp_path) -> None:
    arch, model_cls, overrides = CASES[case]
    path = make_checkpoint(arch, tmp_path / arch, **overrides)
    prompts = random_prompts(300, [5, 23, 1, 40])
    model = load_keel(model_cls, path)
    ours = prefill_logits(model, prompts)
    ref = hf_logits(path, prompts)
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape == (sum(len(p) for p in prompts), 300)
    assert ref.abs().max() > 1.0  # logits are O(1), so the tolerance below is meaningful
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_tolerance_catches_a_wrong_rope(tmp_path) -> None:
    """Guard on the test itself: a model whose rope differs from the checkpoint's must fail."""
    path = make_checkpoint("llama", tmp_path / "a", rope_scaling=LLAMA3_ROPE)
    make_checkpoint("llama", tmp_path / "b")  # same weights, default rope
    prompts = random_prompts(300, [30])
    ours = prefill_logits(load_keel(LlamaForCausalLM, tmp_path / "b"), prompts)
    assert (ours - hf_logits(path, prompts)).abs().max() > 1e-2
