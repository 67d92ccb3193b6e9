"""`no_repeat_ngram`: never complete an n-gram the sequence already holds (transformers'
`no_repeat_ngram_size`, over prompt and output as there), chosen per request by
`extra_args={"no_repeat_ngram_size": n}` (the server's `vllm_xargs`).

Each row keeps a map from every (n-1)-gram seen to the tokens that followed it, extended only by the
tokens committed since the previous step, so a step costs O(new tokens) per row on the host and one
scatter on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from keel.engine.limits import check_int
from keel.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates

ARG = "no_repeat_ngram_size"
MAX_N = 1024


class _Row:
    def __init__(self, n: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        self.n, self.prompt, self.output = n, list(prompt), output
        self.seen: dict[tuple[int, ...], set[int]] = {}
        self.done = 0  # tokens of prompt + output already entered into `seen`

    def banned(self) -> set[int]:
        """Tokens that would complete an n-gram already in prompt + output (after adding the new ones)."""
        n, num_prompt = self.n, len(self.prompt)
        total = num_prompt + len(self.output)
        start = max(0, self.done - n + 1)  # seq is prompt + output from this position on
        seq = self.prompt[start:] + self.output[0:] if start < num_prompt else self.output[start - num_prompt:]
        for end in range(max(self.done, n - 1), total):  # the n-gram ending at position `end`
            gram = seq[end - n + 1 - start:end + 1 - start]
            self.seen.setdefault(tuple(gram[:-1]), set()).add(gram[-1])
        self.done = total
        if total < n - 1:
            return set()
        return self.seen.get(tuple(seq[len(seq) - n + 1:]) if n > 1 else (), set())


class NoRepeatNGramLogitsProcessor(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        n = (sampling_params.extra_args or {}).get(ARG)
        if n is not None:
            check_int(f"extra_args.{ARG}", n, 1, MAX_N)

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.rows: dict[int, _Row] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new_state(params: Any, prompt: Sequence[int], output: Sequence[int]) -> _Row | None:
            n = (params.extra_args or {}).get(ARG)
            return _Row(n, prompt, output) if n else None

        process_dict_updates(self.rows, batch_update, new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:  # logits: [B, vocab]
        rows: list[int] = []
        cols: list[int] = []
        for i, row in self.rows.items():
            banned = row.banned()
            rows += [i] * len(banned)
            cols += sorted(banned)
        if rows:
            index = (torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device))
            logits.index_put_(index, torch.tensor(float("-inf"), device=self.device))
        return logits
