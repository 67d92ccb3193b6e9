"""Prompt types of the offline API, as vLLM's `vllm.inputs` (TypedDicts: plain dicts work the same).

`LLM.generate` takes a string, a `TextPrompt` or a `TokensPrompt` (or a list of them). A key keel does
not act on (multi_modal_data, cache_salt, ...) is an error naming it, never ignored.
"""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt of token ids, used as they are."""

    prompt_token_ids: list[int]
