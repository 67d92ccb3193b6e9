"""vLLM's `bad_words`: a word's last token is banned where its other tokens end the output so far.

The front end tokenizes each word (alone and after a space: `SamplingParams.update_from_tokenizer`);
the sampling metadata asks `banned_by_bad_words` per row each step. A one-token word is always banned.
"""

from __future__ import annotations

from collections.abc import Sequence


def banned_by_bad_words(bad_words_token_ids: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The tokens a row may not sample next (the last token of each bad word whose prefix ends the output)."""
    out = list(output_token_ids)
    banned = []
    for word in bad_words_token_ids:
        prefix = list(word[:-1])
        if not prefix or (len(out) >= len(prefix) and out[len(out) - len(prefix):] == prefix):
            banned.append(word[-1])
    return banned
