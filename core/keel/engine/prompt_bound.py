"""Refusing a prompt far past max_model_len without paying to tokenize all of it.

No token stands for more than `max_token_chars` characters of text (the longest vocabulary entry:
byte-level BPE entries hold one character per byte, and a byte is at most one character). So the first
`(max_model_len + MARGIN) * max_token_chars` characters of a prompt that fits cannot hold more than
max_model_len + MARGIN tokens; if they do, the prompt cannot fit, and a 50 MB text costs the tokenizer
that prefix only. A normalizer that deletes characters only makes the prefix shorter in tokens: then
the whole text is tokenized as before. Nothing that fits is ever refused.
"""

from __future__ import annotations

from typing import Any

from keel.engine.limits import ParamError

# Tokens a prefix may hold beyond max_model_len before the prompt is refused: the cut may split a word
# and so tokenize a little differently from the whole text.
MARGIN = 16


class PromptTooLongError(ParamError):
    """The prompt leaves no room to generate within max_model_len (HTTP 400 in the server)."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(param, message)


class PromptBound:
    """Made once per tokenizer by whoever tokenizes request text (the front end's Processor, the IO
    processors, /tokenize); `encode` is called per prompt, on the tokenizer thread."""

    def __init__(self, tokenizer: Any, max_model_len: int | None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._token_chars: int | None = None

    def max_token_chars(self) -> int:
        if self._token_chars is None:
            self._token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=1) or 1
        return self._token_chars

    def encode(self, text: str, *, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """`tokenizer.encode(text)`, or PromptTooLongError (naming `param`) after tokenizing a prefix."""
        if self.max_model_len is not None:
            budget = self.max_model_len + MARGIN
            limit = budget * self.max_token_chars()
            if len(text) > limit:
                head = self.tokenizer.encode(text[:limit], add_special_tokens=add_special_tokens)
                if len(head) >= budget:
                    raise PromptTooLongError(
                        f"This model's maximum context length (max_model_len) is {self.max_model_len} tokens, "
                        f"but the prompt is longer: its first {limit} of {len(text)} characters already hold "
                        f"{len(head)} tokens. Please reduce the length of the prompt.", param=param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
