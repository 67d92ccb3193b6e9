"""Incremental detokenization with stop strings, as vLLM's output processor does it.

The output processor (API process) keeps one `IncrementalDetokenizer` per completion. Every engine
step it calls `update` with the newly sampled token ids, finishes the request if a stop string was
hit, then takes the text to send with `get_next_output_text`.

Decoding uses vLLM's `detokenize_incrementally` technique: a short window of ids is decoded twice,
once up to `read_offset` (already emitted) and once up to the end, and only the difference is
emitted. The window starts at `prefix_offset`, a few tokens back, so that tokenizers whose decoding
depends on context (a leading-space marker, merged byte sequences) decode the new token as they
would inside the full text. When the window's text ends in U+FFFD the newest token ends in the middle
of a multi-byte UTF-8 character and nothing is emitted until the character is complete. Work per
step is proportional to the new tokens, never to the length of the output.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from keel.engine.stop_checker import check_stop_strings

# How many prompt tokens to keep as decoding context for the first generated token (vLLM's value).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"
# Decoded ids before the window are dropped once this many pile up, so memory stays bounded.
_TRIM_THRESHOLD = 1024


class _TextBuffer:
    """Append-mostly text whose tail can be read and cut without copying the whole string."""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self._len += len(text)

    def text_from(self, start: int) -> str:
        """`str(self)[start:]`, touching only the pieces that end after `start`."""
        start = max(start, 0)
        if start >= self._len:
            return ""
        parts: list[str] = []
        pos = self._len
        for piece in reversed(self._pieces):
            if pos <= start:
                break
            pos -= len(piece)
            parts.append(piece)
        return "".join(reversed(parts))[start - pos :]

    def truncate(self, length: int) -> None:
        while self._len > length:
            piece = self._pieces.pop()
            self._len -= len(piece)
            if self._len < length:
                self._pieces.append(piece[: length - self._len])
                self._len = length

    def __str__(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text, watching for stop strings.

    Called by the output processor: `update` once per engine output of the request, then
    `get_next_output_text` to obtain the text to hand out. Guarantees:

    - at the end (`finished=True`), `output_text` equals `tokenizer.decode(output_token_ids,
      skip_special_tokens=...)`, cut at the stop string if one was hit;
    - the streamed deltas of `get_next_output_text(delta=True)` concatenate to the final text, and no
      streamed text is ever taken back: a character split over several byte tokens is held until it is
      complete, and while stop strings are excluded from the output the last `max(len(stop)) - 1`
      characters are held back until the request finishes;
    - nothing after a stop string ever appears; once one is hit, further `update` calls are ignored.

    `min_tokens` (vLLM's sampling parameter) keeps stop strings from matching inside the first
    `min_tokens` generated tokens.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
        *,
        min_tokens: int = 0,
    ) -> None:
        if tokenizer is None:
            raise TypeError(
                "IncrementalDetokenizer needs a tokenizer; skip detokenization instead of passing None"
            )
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop: list[str] = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        # Held back while streaming, so a partial stop string that is later cut is never sent.
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1 if self.stop and not include_stop_str_in_output else 0
        )
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.token_ids: list[int] = []
        self.stop_string: str | None = None
        self._text = _TextBuffer()
        self._last_output_text_offset = 0
        self._finished = False
        self._vocab_size = len(tokenizer)

        # Decoding window over valid ids: the prompt's tail gives the first new token its context.
        tail = list(prompt_token_ids[-(INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET + 2) :])
        self._ids: list[int] = [i for i in tail if 0 <= i < self._vocab_size]
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
        self._prefix_text: str | None = None  # decode(ids[prefix_offset:read_offset]), cached

    @classmethod
    def from_sampling_params(
        cls, tokenizer: Any, prompt_token_ids: Sequence[int], params: Any
    ) -> IncrementalDetokenizer:
        """Build from any object with vLLM's SamplingParams attribute names (missing ones default)."""
        return cls(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=getattr(params, "skip_special_tokens", True),
            spaces_between_special_tokens=getattr(params, "spaces_between_special_tokens", True),
            stop=_as_stop_list(getattr(params, "stop", None)),
            include_stop_str_in_output=getattr(params, "include_stop_str_in_output", False),
            min_tokens=getattr(params, "min_tokens", 0) or 0,
        )

    @property
    def output_text(self) -> str:
        """All text decoded so far (cut at the stop string), including any held-back tail."""
        return str(self._text)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append newly generated tokens; return the stop string if one is now matched, else None.

        `stop_terminated` says the last id is a stop token (EOS or one of `stop_token_ids`); unless
        stop strings are included in the output, that token is recorded but not decoded into text.
        When a stop string matches, `output_text` is cut before it (or after it, when included) and
        the text of any later tokens in `new_token_ids` is dropped.
        """
        if not new_token_ids or self.stop_string is not None or self._finished:
            return None
        new_token_ids = list(new_token_ids)
        skipped: int | None = None
        if stop_terminated and not self.include_stop_str_in_output:
            skipped = new_token_ids.pop()
        stop_check_offset = len(self._text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self._text.append(self._decode_next(token_id))
            if self.min_tokens and len(self.token_ids) <= self.min_tokens:
                stop_check_offset = len(self._text)
        if skipped is not None:
            self.token_ids.append(skipped)
        return self._check_stop(stop_check_offset)

    def finish(self) -> None:
        """Flush what is still held for an incomplete character; called once the request has ended.

        A stream that ends mid-character decodes (as `tokenizer.decode` does) to U+FFFD; that text is
        added now, without looking for stop strings in it: the replacement characters stand for bytes
        cut off by the end of the output, not for text the model produced, and the request has already
        finished for another reason (a match here would cut text from a "length" completion).
        Idempotent; `get_next_output_text(finished=True)` calls it.
        """
        if self._finished:
            return
        self._finished = True
        if self.stop_string is not None or self._read_offset >= len(self._ids):
            return
        prefix_text = self._window_prefix_text()
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) > len(prefix_text):
            self._text.append(window_text[len(prefix_text) :])

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to hand out now: everything (`delta=False`) or only what is new since the last call.

        While not finished, the last `stop_buffer_length` characters are held back; once finished,
        the rest is released.
        """
        if finished:
            self.finish()
        buffer_length = 0 if finished else self.stop_buffer_length
        length = len(self._text) - buffer_length
        if not delta:
            return str(self._text)[: max(length, 0)]
        last = self._last_output_text_offset
        if last >= length:
            return ""
        self._last_output_text_offset = length
        return self._text.text_from(last)[: length - last]

    def _check_stop(self, stop_check_offset: int) -> str | None:
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        new_char_count = len(self._text) - stop_check_offset
        if new_char_count <= 0:
            return None
        # Only the new text and (longest stop - 1) characters before it can hold a new match.
        base = max(stop_check_offset - self.max_stop_len + 1, 0)
        found = check_stop_strings(
            self._text.text_from(base), new_char_count, self.stop, self.include_stop_str_in_output
        )
        if found is None:
            return None
        stop_string, truncate_to = found
        if truncate_to != -1:
            self._text.truncate(base + truncate_to)
        self.stop_string = stop_string
        return stop_string

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _window_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._prefix_text

    def _decode_next(self, token_id: int) -> str:
        """Text that `token_id` completes; "" while a character is still incomplete."""
        if not 0 <= token_id < self._vocab_size:
            return ""  # ids past the tokenizer's vocabulary (padded embeddings) decode to nothing
        self._ids.append(token_id)
        prefix_text = self._window_prefix_text()
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        if self._prefix_offset > _TRIM_THRESHOLD:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return window_text[len(prefix_text) :]


def _as_stop_list(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return list(stop)


# Per-tokenizer caches of single-token strings; weak keys so a dropped tokenizer frees its cache.
_TOKEN_CACHES: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


def decode_token(tokenizer: Any, token_id: int) -> str:
    """One token decoded on its own, for `Logprob.decoded_token` (cached per tokenizer).

    Matches vLLM: `tokenizer.decode([token_id])`, so a token holding part of a multi-byte character
    decodes to U+FFFD; ids outside the vocabulary decode to "".
    """
    try:
        cache = _TOKEN_CACHES.setdefault(tokenizer, {})
    except TypeError:  # tokenizer objects that cannot be weakly referenced are not cached
        cache = {}
    text = cache.get(token_id)
    if text is None:
        text = tokenizer.decode([token_id]) if 0 <= token_id < len(tokenizer) else ""
        text = text or ""
        cache[token_id] = text
    return text


def decode_tokens(tokenizer: Any, token_ids: Sequence[int]) -> list[str]:
    """`decode_token` for each id (the top-k ids of one logprobs position, say)."""
    return [decode_token(tokenizer, token_id) for token_id in token_ids]
