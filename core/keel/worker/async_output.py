"""AsyncModelRunnerOutput: a step's result whose sampled tokens are still on their way to the host.

The model runner returns one from `execute_model_async` as soon as the step's kernels and a
non-blocking device-to-host copy of the sampled tokens (and logprobs) are enqueued. The engine core
calls `get_output()` when it is ready to apply the step -- with async scheduling, after it has already
scheduled and launched the next step, so host work overlaps the device. `get_output` waits only for
this step's copy (an event), never for later work on the stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from keel.engine.scheduler_output import ModelRunnerOutput


@dataclass
class SampledLaunch:
    """One step's sampled tokens in flight: where they land on the host and in the input batch."""

    req_ids: list[str]  # the step's scheduled requests, batch order
    sampling_idx: list[int]  # [S] batch indices that sampled, in logits row order
    rows: np.ndarray  # [S] InputBatch rows of those requests
    generations: np.ndarray  # [S] the rows' generation at launch (a reused row must not be written)
    positions: np.ndarray  # [S] token index each sampled token takes in its row
    sampled: torch.Tensor  # [S] int64 on the device: the next step's inputs are gathered from here
    sampled_host: torch.Tensor  # [S] int64, pinned when the device is not the host
    logprobs_host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # [S, k + 1] ids, logprobs, ranks
    num_logprobs: list[int | None]  # per sampled row, the request's `logprobs` setting
    event: torch.Event | None  # recorded after the copies; None on the host


class AsyncModelRunnerOutput:
    """Returned by `ModelRunner.execute_model_async`; `get_output` may be called any number of times."""

    def __init__(self, output: ModelRunnerOutput, launch: SampledLaunch | None,
                 commit: Callable[[SampledLaunch, list[int]], None] | None = None) -> None:
        self._output = output
        self._launch = launch
        self._commit = commit
        self._done = launch is None

    @property
    def launch(self) -> SampledLaunch | None:
        return self._launch

    @property
    def is_done(self) -> bool:
        return self._done

    def get_output(self) -> ModelRunnerOutput:
        """Wait for this step's tokens, tell the runner (it records them), and return the plain output."""
        if self._done:
            return self._output
        launch = self._launch
        if launch.event is not None:
            launch.event.synchronize()
        tokens = launch.sampled_host.tolist()
        if self._commit is not None:
            self._commit(launch, tokens)
        out = self._output
        for i, tok in zip(launch.sampling_idx, tokens):
            out.sampled_token_ids[i] = [tok]
        if launch.logprobs_host is not None:
            cols = tuple(t.tolist() for t in launch.logprobs_host)
            for j, (i, k) in enumerate(zip(launch.sampling_idx, launch.num_logprobs)):
                if k is not None:
                    out.logprobs[launch.req_ids[i]] = tuple([col[j][: k + 1]] for col in cols)
        self._done = True
        return out
