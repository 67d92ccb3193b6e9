"""Mistral: the Llama architecture with a sliding window on every layer (from `config.sliding_window`)."""

from __future__ import annotations

from keel_models_llama.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """No biases; `layer_sliding_window` already reads Mistral's window, so nothing else differs."""
