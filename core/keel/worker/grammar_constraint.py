"""GrammarConstraint: a step's grammar bitmask as the model runner's sampling sees it.

The scheduler plans the bitmask and its fill runs on the structured-output manager's thread
(`keel.structured_output.manager.GrammarBitmask`). The runner copies the (pinned) bitmask to the device
without blocking, on the same stream after the forward, right before sampling -- waiting for the fill
first if it is still running. A bitmask in pageable memory (a worker in another process receives it
filled) travels with the step's inputs instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from keel.layers.token_bitmask import grammar_logits_rows
from keel.structured_output.manager import GrammarBitmask


@dataclass(frozen=True)
class GrammarConstraint:
    handle: GrammarBitmask
    rows: torch.Tensor  # [R] int64 on the device: the logits row each bitmask row constrains
    staged: torch.Tensor | None  # [R, W] int32 on the device when the bitmask travelled with the inputs

    @property
    def ready(self) -> bool:
        """Sampling can be enqueued now without waiting for the host's fill."""
        return self.staged is not None or self.handle.done()

    def on_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(bitmask [R, W] int32, rows [R]) on `device`; waits for the fill if it is still running."""
        if self.staged is not None:
            return self.staged, self.rows
        return self.handle.result().to(device, non_blocking=True), self.rows


def grammar_arrays(grammar: GrammarBitmask | None, sampling_req_ids: Sequence[str],
                   num_sample_rows: np.ndarray) -> dict[str, np.ndarray]:
    """The host arrays a step stages for its bitmask (none without one): "grammar_rows", the logits row of
    each bitmask row, and "grammar_bitmask" [R, W] int32 when the fill is already done at launch."""
    if grammar is None:
        return {}
    arrays = {"grammar_rows": grammar_logits_rows(grammar.req_ids, sampling_req_ids, num_sample_rows)}
    if grammar.done() and not grammar.pinned:  # filled, pageable: it travels with the inputs
        arrays["grammar_bitmask"] = grammar.result().numpy()
    return arrays


def staged_constraint(grammar: GrammarBitmask | None, staged: dict[str, torch.Tensor]) -> GrammarConstraint | None:
    """The step's constraint from its staged arrays (`grammar_arrays`), or None without a bitmask."""
    if grammar is None:
        return None
    return GrammarConstraint(grammar, staged["grammar_rows"], staged.get("grammar_bitmask"))
