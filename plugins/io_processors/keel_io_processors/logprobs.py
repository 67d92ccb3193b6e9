"""Logprobs in OpenAI's two response shapes: completions (`tokens`/`token_logprobs`/`top_logprobs`/
`text_offset`) and chat (`content: [{token, logprob, bytes, top_logprobs}]`)."""

from __future__ import annotations

from typing import Any

from keel.engine.outputs import Logprob

# JSON has no -inf; OpenAI clients expect a number (vLLM uses the same floor).
_FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(float(value), _FLOOR)


def _token_text(token_id: int, lp: Logprob, tokenizer: Any) -> str:
    if lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def _top(entries: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = [(tid, lp) for tid, lp in entries.items() if lp.rank is not None and lp.rank <= k]
    return sorted(ranked, key=lambda item: item[1].rank or 0)


class CompletionLogprobs:
    """Accumulates the completions-API logprobs object for one choice; `text_offset` continues across
    streamed deltas (offsets count characters of the choice's text, echoed prompt included)."""

    def __init__(self, num: int, tokenizer: Any, text_offset: int = 0) -> None:
        self.num = num
        self.tokenizer = tokenizer
        self.offset = text_offset

    def build(self, token_ids: list[int], logprobs: list[dict[int, Logprob] | None]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entries in zip(token_ids, logprobs):
            if entries is None or tid not in entries:  # the first prompt token has no logprob
                text = self.tokenizer.decode([tid]) if self.tokenizer is not None else ""
                out["tokens"].append(text)
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                text = _token_text(tid, entries[tid], self.tokenizer)
                out["tokens"].append(text)
                out["token_logprobs"].append(_lp(entries[tid].logprob))
                top = {_token_text(t, lp, self.tokenizer): _lp(lp.logprob) for t, lp in _top(entries, self.num)}
                top.setdefault(text, _lp(entries[tid].logprob))
                out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], num: int,
                  tokenizer: Any) -> dict[str, Any]:
    """The chat-API logprobs object for some tokens of one choice."""
    content = []
    for tid, entries in zip(token_ids, logprobs):
        sampled = entries[tid]
        text = _token_text(tid, sampled, tokenizer)
        content.append({
            "token": text,
            "logprob": _lp(sampled.logprob),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := _token_text(i, lp, tokenizer)), "logprob": _lp(lp.logprob),
                 "bytes": list(t.encode("utf-8"))}
                for i, lp in _top(entries, num)
            ],
        })
    return {"content": content}
