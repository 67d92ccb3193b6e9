"""Qwen2: the Llama architecture with biases on q/k/v (not on o_proj) and optional sliding window layers."""

from __future__ import annotations

from typing import Any

from keel_models_llama.llama import LlamaForCausalLM, LlamaVariant


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def variant(cls, config: Any) -> LlamaVariant:
        return LlamaVariant(qkv_bias=True)
