"""DraftProposer: the protocol of a speculative-decoding method, registered under the `spec_decoder` kind.

The model runner builds the proposer once (`cls(ProposerContext)`) when `speculative_config.method`
names it, and calls `propose` after every step for the requests that sampled. Drafts are tentative:
the scheduler gives them KV slots as lookahead tokens, the next step verifies them all in one forward
pass, and rejected ones are rolled back (they never enter the prefix cache).

Verification (worker/model_runner.py) samples the target at every draft position with exactly the
sampling state a non-speculative step would have used (same seed counter, penalties seeing the earlier
drafts), accepts the leading drafts equal to those samples and emits the first differing sample (or a
bonus token when all match). For deterministic drafts this is rejection sampling with a one-hot proposal
-- a draft d is accepted with probability p(d), otherwise a token is drawn from p without d -- so the
output distribution is the target's; for seeded requests outputs are even identical token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer gets at construction. Frozen: fields are only ever added."""

    method: str
    num_speculative_tokens: int
    options: tuple[tuple[str, Any], ...]  # method-specific settings from speculative_config
    model: torch.nn.Module  # the target model (an MTP proposer reads its draft modules from it)
    device: torch.device

    def option(self, name: str, default: Any) -> Any:
        return dict(self.options).get(name, default)


@dataclass(frozen=True)
class DraftInput:
    """Per step, for the requests that sampled. Frozen: fields are only ever added."""

    req_ids: list[str]
    token_ids: list[list[int]]  # committed tokens of each request, including those accepted this step
    max_drafts: list[int]  # drafts wanted per request (already capped by lengths and max_tokens)
    hidden_states: torch.Tensor | None = None  # [num_tokens, hidden] of this step's target forward
    last_hidden_rows: list[int] | None = None  # per request: row of its last accepted token


@runtime_checkable
class DraftProposer(Protocol):
    def propose(self, batch: DraftInput) -> list[list[int]]:
        """Called by the runner after sampling; returns at most max_drafts[i] draft tokens per request."""
        ...
