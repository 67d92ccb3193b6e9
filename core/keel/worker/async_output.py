"""AsyncModelRunnerOutput: a step's result whose sampled tokens are still on their way to the host.

The model runner returns one from `execute_model_async` as soon as the step's kernels and a
non-blocking device-to-host copy of the sampled tokens (and logprobs) are enqueued. The engine core
calls `get_output()` when it is ready to apply the step -- with async scheduling, after it has already
scheduled and launched the next step, so host work overlaps the device. `get_output` waits only for
this step's copy (an event), never for later work on the stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from keel.engine.scheduler_output import ModelRunnerOutput
from keel.worker.input_batch import InputBatch


@dataclass
class SampledLaunch:
    """One step's sampled tokens in flight: where they land on the host and in the input batch.

    The tensors are set once sampling is enqueued. A step whose grammar bitmask was still being filled
    at launch has its sampling `pending` until `finish` (the next step's start, or `get_output`)."""

    req_ids: list[str]  # the step's scheduled requests, batch order
    sampling_idx: list[int]  # [S] batch indices that sampled, in logits row order
    rows: np.ndarray  # [S] InputBatch rows of those requests
    generations: np.ndarray  # [S] the rows' generation at launch (a reused row must not be written)
    positions: np.ndarray  # [S] token index each sampled token takes in its row
    num_logprobs: list[int]  # per sampled row, the request's `logprobs` setting (-1: None)
    states: list  # [S] the requests' CachedRequestState (the runner's mirrors at launch)
    sampled: torch.Tensor | None = None  # [S] int64 on the device: the next step's inputs are gathered from here
    sampled_host: torch.Tensor | None = None  # [S] int64, pinned when the device is not the host
    logprobs_host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # [S, k + 1] ids, logprobs, ranks
    event: torch.Event | None = None  # recorded after the copies; None on the host
    # Enqueues sampling and sets the tensors above on the launch it is given; it does not hold the launch
    # (a closure over it, stored here, would make every pending step a reference cycle).
    pending: Callable[[SampledLaunch], None] | None = None
    enqueued: threading.Event = field(default_factory=threading.Event)  # set once the tensors above are set

    def finish(self) -> None:
        """Enqueue the pending sampling, if any (waits for the grammar bitmask's fill on the host)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending(self)


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
        launch.finish()
        if launch.event is not None:
            launch.event.synchronize()
        tokens = launch.sampled_host.tolist()
        if self._commit is not None:
            self._commit(launch, tokens)
        out = self._output
        if len(tokens) == len(out.req_ids):  # every request sampled: sampling_idx is 0..n-1
            out.sampled_token_ids = [[tok] for tok in tokens]
        else:
            for i, tok in zip(launch.sampling_idx, tokens):
                out.sampled_token_ids[i] = [tok]
        if launch.logprobs_host is not None:
            ids, lps, ranks = (t.tolist() for t in launch.logprobs_host)
            width = len(ids[0]) if ids else 0
            req_ids, logprobs = launch.req_ids, out.logprobs
            for j, (i, k) in enumerate(zip(launch.sampling_idx, launch.num_logprobs)):
                if k + 1 == width:  # the most any row asked for: its whole row
                    logprobs[req_ids[i]] = ([ids[j]], [lps[j]], [ranks[j]])
                elif k >= 0:
                    logprobs[req_ids[i]] = ([ids[j][: k + 1]], [lps[j][: k + 1]], [ranks[j][: k + 1]])
        self._done = True
        return out

    def wait_sampled(self, timeout: float) -> dict[str, int] | None:
        """{req_id: sampled token} of this step once the tokens are on the host, or None if its sampling
        was not enqueued within `timeout` seconds (the caller may ask again). Safe from any thread: it
        reads the host copy and commits nothing (`get_output` does that). The structured-output fill
        thread calls it to advance the grammars the moment the tokens land, while the engine loop is
        still busy elsewhere."""
        launch = self._launch
        if launch is None:
            out = self._output
            return {rid: t[0] for rid, t in zip(out.req_ids, out.sampled_token_ids, strict=True) if t}
        if not launch.enqueued.wait(timeout):
            return None
        if launch.event is not None:
            launch.event.synchronize()
        tokens = launch.sampled_host.tolist()
        return {launch.req_ids[i]: tok for i, tok in zip(launch.sampling_idx, tokens, strict=True)}


class InFlightTokens:
    """The model runner's tokens sampled on the device that the host has not committed yet.

    At most one launched step is pending when the next one is prepared (the engine core applies step N
    before it schedules step N+2). `fixups` says which of the next step's input tokens must come from
    that step's device tensor; `commit` (called by `get_output`) writes the values into the input batch
    and the request mirrors whose rows still belong to the same requests.
    """

    def __init__(self, batch: InputBatch) -> None:
        self.batch = batch
        self.last: AsyncModelRunnerOutput | None = None
        self.num_device_fed_tokens = 0  # input tokens taken from a previous step's device output

    @property
    def sampled(self) -> torch.Tensor:  # [S] int64 on the device: the pending step's tokens
        return self.last.launch.sampled

    def finish_sampling(self) -> None:
        """Enqueue the pending step's sampling if it still waits for its grammar bitmask. Called by the
        runner first thing in a step: the step's inputs may be that sampling's tokens (`fixups`)."""
        if self.last is not None:
            self.last.launch.finish()

    def track(self, output: ModelRunnerOutput, launch: SampledLaunch | None) -> AsyncModelRunnerOutput:
        """Wrap a step's output; a step that launched sampling becomes the pending one."""
        result = AsyncModelRunnerOutput(output, launch, self.commit)
        if launch is not None:
            self.last = result
        return result

    def wait(self) -> None:
        """Commit the pending step now (steps that read host token ids: drafts, proposers)."""
        if self.last is not None:
            self.last.get_output()

    def fixups(self, rows: np.ndarray, num_scheduled: np.ndarray,
               query_start_loc: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(flat input indices, indices into the pending step's sampled tensor) for this step's input
        tokens the host has not received yet; None if there are none. rows, num_scheduled: [num_reqs];
        query_start_loc: [num_reqs + 1]."""
        last, batch = self.last, self.batch
        if last is None or last.is_done:
            return None
        launch = last.launch
        valid = batch.generation[launch.rows] == launch.generations
        lookup = np.full(batch.capacity, -1, dtype=np.int64)
        lookup[launch.rows[valid]] = np.flatnonzero(valid)
        src = lookup[rows]  # [num_reqs]
        has = src >= 0
        if not has.any():
            return None
        src = src[has]
        offset = launch.positions[src] - batch.num_computed_tokens[rows[has]]
        inside = (offset >= 0) & (offset < num_scheduled[has])
        if not inside.any():
            return None
        dst = query_start_loc[:-1][has][inside].astype(np.int64) + offset[inside]
        self.num_device_fed_tokens += int(dst.shape[0])
        return dst, src[inside]

    def commit(self, launch: SampledLaunch, tokens: list[int]) -> None:
        """The host learns a launched step's tokens (a row freed and reused meanwhile is left alone)."""
        batch = self.batch
        same = batch.generation[launch.rows] == launch.generations
        values = np.asarray(tokens, dtype=np.int64)
        # A mirror whose row was reassigned since launch was forgotten (a resumed request gets a new
        # one): appending to it changes nothing the runner reads.
        if same.all():
            batch.fill_tokens(launch.rows, launch.positions, values)
            for state, tok in zip(launch.states, tokens):
                state.token_ids.append(tok)
        else:
            batch.fill_tokens(launch.rows[same], launch.positions[same], values[same])
            for state, tok, keep in zip(launch.states, tokens, same.tolist()):
                if keep:
                    state.token_ids.append(tok)
        if self.last is not None and self.last.launch is launch:
            self.last = None
