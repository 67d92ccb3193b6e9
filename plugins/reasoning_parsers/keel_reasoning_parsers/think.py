"""Reasoning parsers for models that think between `<think>` and `</think>`.

The two conventions differ only when the output holds no tag at all:
- DeepSeek-R1's template ends the prompt with `<think>`, so the output starts inside the reasoning:
  everything before `</think>` is reasoning, and an output without any tag is all reasoning.
- Qwen3 writes `<think>` itself when it thinks (or its template opens it, and then the output holds only
  `</think>`); an output with neither tag is all content (thinking switched off). Streamed, Qwen3
  text before any tag is content: whether a `</think>` follows is unknowable then, so an output that
  only closes the tag is split correctly in whole responses, but streams its reasoning as content.
"""

from __future__ import annotations

from keel.reasoning import ReasoningParser

START, END = "<think>", "</think>"


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (a tag still arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkReasoningParser(ReasoningParser):
    starts_in_reasoning = False  # an output without tags: reasoning (R1) or content (Qwen3)

    def split(self, text: str, final: bool = True) -> tuple[str | None, str | None]:
        start, end = text.find(START), text.find(END)
        if start >= 0 and (end < 0 or start < end):
            prefix, inside = text[:start], text[start + len(START):]  # text before the tag is content
        elif end >= 0 or self.starts_in_reasoning:
            if not final and end < 0 and text.strip() and START.startswith(text.lstrip()):
                return None, None  # an opening tag may be arriving: decide when it has
            prefix, inside = "", text
        else:
            hold = 0 if final else _partial_tail(text, START)
            return None, text[: len(text) - hold] or None
        end = inside.find(END)
        if end < 0:
            hold = 0 if final else _partial_tail(inside, END)
            reasoning, after = inside[: len(inside) - hold], ""
        else:
            reasoning, after = inside[:end], inside[end + len(END):]
        return reasoning or None, (prefix + after) or None


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    starts_in_reasoning = True


class Qwen3ReasoningParser(ThinkReasoningParser):
    starts_in_reasoning = False
