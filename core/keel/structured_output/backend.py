"""The `structured_output` plugin kind: a grammar library behind two small protocols.

A backend (e.g. plugin structured-output-xgrammar) is registered under `structured_output` with its
library's name. Who calls what:

- The front end's `Processor` calls `Backend.validate(params)` (a classmethod: no tokenizer, no
  compile) for every request with `structured_outputs`, before anything is queued; a ValueError there
  is the user's error (HTTP 400) and must name the problem.
- The engine core's `StructuredOutputManager` builds one backend instance (`cls(BackendContext)`) on
  its compile thread when the first such request arrives, then calls `compile(params)` on that thread
  (once per distinct `params.cache_key()`), and `grammar(compiled)` once per request.
- The scheduler owns each request's `StructuredOutputGrammar`: `fill_bitmask` when the request samples
  a token this step, `accept_tokens` with the tokens it committed: on the engine loop's thread or on the
  manager's fill thread, never both at once (the loop waits for the fill thread's work on them).
  With speculative decoding it also keeps only the drafts `validate_tokens` returns, and fills one row
  per verify position: `accept_tokens` through the drafts tentatively, then `rollback`.

The token bitmask is int32 `[rows, ceil(vocab_size / 32)]`; bit `t % 32` of word `t // 32` set means
token `t` is allowed (the layout xgrammar and vLLM use).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from keel.structured_output.params import StructuredOutputsParams


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass(frozen=True)
class BackendContext:
    """What a backend gets at construction. Frozen: fields are only ever added."""

    tokenizer: Any  # the Hugging Face tokenizer of the served model
    vocab_size: int  # the model's logits width (may exceed the tokenizer's vocabulary)
    eos_token_id: int | None


@runtime_checkable
class StructuredOutputGrammar(Protocol):
    """One request's matcher state; used by one thread at a time (the engine loop or the fill thread)."""

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advance by committed tokens; False if a token is not allowed (the state is then unchanged)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into the whole row `bitmask[row]` (int32 [rows, words], CPU; its
        previous contents are garbage)."""

    def is_terminated(self) -> bool:
        """The grammar has accepted a stop token: nothing may follow (and no bitmask can be filled)."""

    def validate_tokens(self, tokens: Sequence[int]) -> list[int]:
        """The longest prefix of `tokens` the grammar would accept from here; the state is unchanged."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""


@runtime_checkable
class StructuredOutputBackend(Protocol):
    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        """Raise ValueError naming what is wrong with the constraint (or what this backend cannot do)."""

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled constraint for `grammar` (may take a while; runs off the engine loop)."""

    def grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh matcher for one request."""

    # Optional: `fill_bitmasks(grammars, bitmask, rows)` fills the whole rows `bitmask[rows[i]]` (rows None:
    # `bitmask[i]`) for `grammars[i]` (its own grammars, none terminated) in one call -- e.g. on threads.
    # The manager uses it for the rows of a step that need no tentative advance; without it, each
    # grammar's `fill_bitmask`. It runs on the fill thread while the engine loop runs Python: each
    # library call that releases the GIL costs a handoff, and its Python holds the loop up.
    # Optional: `accept_tokens_batch(grammars, tokens) -> list[bool]`, `grammars[i].accept_tokens([tokens[i]])`
    # for all in one call; the manager uses it to advance a step's grammars on its fill thread.
