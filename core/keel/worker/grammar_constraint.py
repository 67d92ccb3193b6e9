"""GrammarConstraint: a step's grammar bitmask as the model runner's sampling sees it.

The scheduler plans the bitmask and its fill runs on the structured-output manager's thread
(`keel.structured_output.manager.GrammarBitmask`). The runner stages the bitmask with the step's inputs
when it is already filled at launch; otherwise it launches the forward without it and, right before
sampling, waits for the fill and copies the (pinned) bitmask to the device without blocking, on the
same stream after the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
