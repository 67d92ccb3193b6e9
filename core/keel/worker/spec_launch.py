"""A speculative step in flight: what it verified and proposed, on the device, until the host has it.

With a draft proposer every step of the model runner is a verify step (`worker/spec_step.py`) and ends as a
`SpecLaunch`: per scheduled request the tokens it emitted (the accepted drafts, then one sampled token),
how many, and the drafts proposed for the next step -- device tensors, copied to pinned host memory
behind one event. `AsyncSpecOutput.get_output()` waits for that event only, then commits the tokens to
the runner's input batch and request mirrors (`SpecStepRunner.commit`) and returns the plain output.

Under async scheduling the next step is prepared before that wait. The scheduler counted every draft
of this step as accepted (its placeholders), so the next step reads its bonus token, its drafts and
the rejected count that lowers its positions from this launch's device tensors (`SpecStepRunner`'s
device fix-ups); a request whose step was already committed is corrected on the host instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from keel.engine.scheduler_output import ModelRunnerOutput
from keel.worker.async_output import AsyncModelRunnerOutput


@dataclass
class SpecLaunch:
    """One verify step's results. R = scheduled requests (batch order), K = num_speculative_tokens."""

    req_ids: list[str]
    rows: np.ndarray  # [R] InputBatch rows
    generations: np.ndarray  # [R] the rows' generation at launch (a reused row is never written)
    sampled: np.ndarray  # [R] bool: the request sampled this step (a prefill chunk may not)
    num_drafts: np.ndarray  # [R] int64: drafts the scheduler counted (placeholders included)
    first_sample_row: np.ndarray  # [R] int64: its first logits row (valid where sampled)
    num_logprobs: list[int | None]  # [R] each request's `logprobs` setting
    emitted: torch.Tensor  # [R, 1 + K] int64, device: emitted tokens first (the rest is padding)
    num_emitted: torch.Tensor  # [R] int64, device: 1 + accepted drafts where sampled, else 0
    drafts: torch.Tensor | None  # [R, K] int64, device: next step's drafts (-1: none); None: host proposer
    rejected: torch.Tensor  # [R + 1] int64, device: counted drafts not accepted; entry R is 0 ("no entry")
    last_tokens: torch.Tensor  # [R] int64, device: each request's last emitted token
    host: dict[str, torch.Tensor]  # the same tensors (and logprobs [S, k + 1]) in pinned host memory
    event: torch.Event | None  # recorded after the host copies; None when the device is the host
    num_emitted_host: np.ndarray | None = None  # [R], once committed
    drafts_host: list[list[int]] | None = None  # [R] the next step's drafts, once committed (or proposed)

    @property
    def is_committed(self) -> bool:
        return self.num_emitted_host is not None

    def entries(self, rows: np.ndarray) -> np.ndarray:
        """Index of each of `rows` in this launch (the same request still holds it), or -1."""
        lookup = {int(r): e for e, r in enumerate(self.rows.tolist())}
        return np.fromiter((lookup.get(int(r), -1) for r in rows), dtype=np.int64, count=rows.shape[0])

    def rejected_host(self, entries: np.ndarray) -> np.ndarray:
        """Drafts the scheduler counted that were not accepted, per entry (committed launches only)."""
        return self.num_drafts[entries] - np.maximum(self.num_emitted_host[entries] - 1, 0)



class AsyncSpecOutput(AsyncModelRunnerOutput):
    """Returned by the runner for a verify step; `get_output` may be called any number of times. The
    commit callable (`SpecStepRunner.commit`) writes the launch's tokens into the runner and `output`."""

    def get_output(self) -> ModelRunnerOutput:
        """Wait for this step's copies, commit its tokens to the runner, return the plain output."""
        if not self._done:
            launch = self._launch
            if launch.event is not None:
                launch.event.synchronize()
            self._commit(launch, self._output)
            self._done = True
        return self._output
