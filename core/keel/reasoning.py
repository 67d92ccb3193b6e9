"""The `reasoning_parser` plugin kind: split a reasoning model's output into reasoning and content.

Who calls what: the chat IO processor builds one parser per server (`cls(tokenizer)`) when the
server's `reasoning_parser` option names a key; it calls `split(text)` on each finished choice
(`message.reasoning_content` / `message.content`) and, when streaming, feeds each choice's text deltas
through a `ReasoningStream`, which turns `split(text_so_far, final=False)` into deltas. A parser only
has to say, for a text, what is reasoning and what is content -- holding back a tag that may still be
arriving when `final` is False, so that what it returns only ever grows.
"""

from __future__ import annotations

from typing import Any


class ReasoningParser:
    """Base class of `reasoning_parser` entries."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def split(self, text: str, final: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of `text`; either may be None. With final=False, `text` is a prefix of
        the output and the result must be a prefix-wise growing pair as more text arrives."""
        raise NotImplementedError


class ReasoningStream:
    """One streamed choice: text deltas in, (reasoning delta, content delta) out."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.reasoning = ""
        self.content = ""

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        self.text += delta
        reasoning, content = self.parser.split(self.text, final=final)
        reasoning, content = reasoning or "", content or ""
        out = (reasoning[len(self.reasoning):] if reasoning.startswith(self.reasoning) else "",
               content[len(self.content):] if content.startswith(self.content) else "")
        self.reasoning = reasoning if reasoning.startswith(self.reasoning) else self.reasoning
        self.content = content if content.startswith(self.content) else self.content
        return out
