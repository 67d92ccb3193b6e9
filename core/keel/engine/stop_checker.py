"""Stop-string matching over detokenized text (vLLM's `StopChecker.check_stop_strings`)."""

from __future__ import annotations

from collections.abc import Sequence


def check_stop_strings(
    output_text: str,
    new_char_count: int,
    stop: Sequence[str],
    include_in_output: bool,
) -> tuple[str, int] | None:
    """Look for a stop string that ends inside the last `new_char_count` characters of `output_text`.

    Called by `IncrementalDetokenizer.update` after appending newly decoded text. Only the new text and
    up to `len(stop_str) - 1` characters before it are searched, so text already checked is never
    scanned again and a stop string that straddles two updates is still found. When several stop
    strings match, the one that starts first wins (the longest on a tie), because everything after
    the first match is cut.

    Returns None, or `(stop_str, truncate_to)`: the output should be cut to `output_text[:truncate_to]`,
    which is the start of the stop string (excluded) or its end (included); `truncate_to` is -1 when
    an included stop string ends exactly at the end of the text and nothing needs cutting.
    """
    if new_char_count <= 0 or not stop:
        return None
    text_len = len(output_text)
    best: tuple[int, int, str] | None = None  # (start, -len, stop_str) orders by start, then longest
    for stop_str in stop:
        if not stop_str:
            continue
        start = max(text_len - new_char_count - len(stop_str) + 1, 0)
        index = output_text.find(stop_str, start)
        if index == -1:
            continue
        key = (index, -len(stop_str), stop_str)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    index, _, stop_str = best
    if not include_in_output:
        return stop_str, index
    end = index + len(stop_str)
    return stop_str, (-1 if end >= text_len else end)
