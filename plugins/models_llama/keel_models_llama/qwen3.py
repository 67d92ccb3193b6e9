"""Qwen3 (dense): the Llama architecture with a per-head RMSNorm on q and k before rope."""

from __future__ import annotations

from typing import Any

from keel_models_llama.llama import LlamaForCausalLM, LlamaVariant


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def variant(cls, config: Any) -> LlamaVariant:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return LlamaVariant(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
