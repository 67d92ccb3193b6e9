"""Logprobs in OpenAI's two response shapes: completions (`tokens`/`token_logprobs`/`top_logprobs`/
`text_offset`) and chat (`content: [{token, logprob, bytes, top_logprobs}]`). With vLLM's
`return_tokens_as_token_ids` every token is named "token_id:<id>" instead of by its text."""

from __future__ import annotations

from typing import Any

from keel.engine.outputs import Logprob

# JSON has no -inf; OpenAI clients expect a number (vLLM uses the same floor).
_FLOOR = -9999.0


def clamp(value: float) -> float:
    return max(float(value), _FLOOR)


def token_text(token_id: int, lp: Logprob | None, tokenizer: Any, as_ids: bool = False) -> str:
    """How a logprob entry names its token: its text, or "token_id:<id>" (return_tokens_as_token_ids)."""
    if as_ids or tokenizer is None and (lp is None or lp.decoded_token is None):
        return f"token_id:{token_id}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def _top(entries: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = [(tid, lp) for tid, lp in entries.items() if lp.rank is not None and lp.rank <= k]
    return sorted(ranked, key=lambda item: item[1].rank or 0)


class CompletionLogprobs:
    """Accumulates the completions-API logprobs object for one choice; `text_offset` continues across
    streamed deltas (offsets count characters of the choice's text, echoed prompt included)."""

    def __init__(self, num: int, tokenizer: Any, text_offset: int = 0, as_ids: bool = False) -> None:
        self.num = num
        self.tokenizer = tokenizer
        self.offset = text_offset
        self.as_ids = as_ids

    def build(self, token_ids: list[int], logprobs: list[dict[int, Logprob] | None]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entries in zip(token_ids, logprobs):
            if entries is None or tid not in entries:  # the first prompt token has no logprob
                text = token_text(tid, None, self.tokenizer, self.as_ids) if self.tokenizer or self.as_ids else ""
                out["tokens"].append(text)
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                text = token_text(tid, entries[tid], self.tokenizer, self.as_ids)
                out["tokens"].append(text)
                out["token_logprobs"].append(clamp(entries[tid].logprob))
                top = {token_text(t, lp, self.tokenizer, self.as_ids): clamp(lp.logprob)
                       for t, lp in _top(entries, self.num)}
                top.setdefault(text, clamp(entries[tid].logprob))
                out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], num: int,
                  tokenizer: Any, as_ids: bool = False) -> dict[str, Any]:
    """The chat-API logprobs object for some tokens of one choice."""
    content = []
    for tid, entries in zip(token_ids, logprobs):
        sampled = entries[tid]
        text = token_text(tid, sampled, tokenizer, as_ids)
        content.append({
            "token": text,
            "logprob": clamp(sampled.logprob),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := token_text(i, lp, tokenizer, as_ids)), "logprob": clamp(lp.logprob),
                 "bytes": list(t.encode("utf-8"))}
                for i, lp in _top(entries, num)
            ],
        })
    return {"content": content}
