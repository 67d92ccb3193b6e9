"""N-gram (prompt lookup) drafts: if the last n tokens occurred earlier in the request, propose the
tokens that followed their latest earlier occurrence. Model-free; options prompt_lookup_min/max."""

from __future__ import annotations

from keel.spec_decode.proposer import DraftInput, ProposerContext


class NgramProposer:
    def __init__(self, ctx: ProposerContext) -> None:
        self.k = ctx.num_speculative_tokens
        self.n_min = int(ctx.option("prompt_lookup_min", 1))
        self.n_max = int(ctx.option("prompt_lookup_max", 4))
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError(
                f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.n_min}, {self.n_max}"
            )

    def propose(self, batch: DraftInput) -> list[list[int]]:
        return [self._one(tokens, min(self.k, m)) for tokens, m in zip(batch.token_ids, batch.max_drafts)]

    def _one(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        n_tok = len(tokens)
        for n in range(min(self.n_max, n_tok - 1), self.n_min - 1, -1):
            suffix = tokens[n_tok - n :]
            # latest earlier occurrence whose continuation exists
            for start in range(n_tok - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    follow = tokens[start + n : start + n + k]
                    if follow:
                        return follow
        return []
