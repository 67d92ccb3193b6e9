"""The model runner's logits processors and the layout of their rows (`keel.logits_processor`).

A step's logits have one row per request that samples, in the scheduler's order. `LogitsProcessorBatch`
remembers which request each row held at the previous step and hands every processor the difference
as a `BatchUpdate` -- removed indices, added requests placed in free indices, then the moves (one-way
into free indices, swaps otherwise) that put every request at its row -- so a processor keyed by index
stays right whatever the scheduler reorders. A request that does not sample in a step (a prefill chunk)
leaves and is added again later; one resumed after preemption is added anew (a new output list).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from keel.logits_processor import BatchUpdate, LogitsProcessor, LogitsProcessors, MoveDirectionality
from keel.worker.request_state import CachedRequestState


class OutputTokens(Sequence[int]):
    """A live view of a request's output token ids (its token list past the prompt)."""

    def __init__(self, state: CachedRequestState) -> None:
        self._tokens = state.token_ids
        self._start = state.num_prompt_tokens

    def __len__(self) -> int:
        return len(self._tokens) - self._start

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return self._tokens[self._start:][i]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("output token index out of range")
        return self._tokens[self._start + i]


class LogitsProcessorBatch:
    """Called by the model runner once per sampling step (`step`), before the sampler."""

    def __init__(self, processors: Sequence[LogitsProcessor]) -> None:
        self.processors = tuple(processors)
        self.groups = LogitsProcessors(
            non_argmax_invariant=tuple(p for p in self.processors if not p.is_argmax_invariant()),
            argmax_invariant=tuple(p for p in self.processors if p.is_argmax_invariant()),
        )
        self._rows: dict[str, tuple[int, CachedRequestState]] = {}  # req id -> (row, state) last step

    def step(self, states: Sequence[CachedRequestState]) -> LogitsProcessors:
        """`states`: the requests of this step's logits rows, in row order."""
        update = self.diff(states)
        for p in self.processors:
            p.update_state(update)
        return self.groups

    def diff(self, states: Sequence[CachedRequestState]) -> BatchUpdate | None:
        """The update from the previous layout to `states` (and remember it); None if unchanged."""
        wanted = {s.req_id: s for s in states}
        removed = sorted(row for rid, (row, st) in self._rows.items() if wanted.get(rid) is not st)
        where = {rid: row for rid, (row, st) in self._rows.items() if wanted.get(rid) is st}
        held = {row: rid for rid, row in where.items()}
        free = (i for i in itertools.count() if i not in held)
        added = []
        for s in states:
            if s.req_id not in where:
                row = next(free)
                where[s.req_id], held[row] = row, s.req_id
                added.append((row, s.sampling_params, s.prompt_token_ids, OutputTokens(s)))
        moved = []
        for target, s in enumerate(states):
            source = where[s.req_id]
            if source == target:
                continue
            other = held.get(target)
            if other is None:
                moved.append((source, target, MoveDirectionality.UNIDIRECTIONAL))
                del held[source]
            else:
                moved.append((source, target, MoveDirectionality.SWAP))
                held[source], where[other] = other, source
            held[target], where[s.req_id] = s.req_id, target
        self._rows = {s.req_id: (i, s) for i, s in enumerate(states)}
        if not (removed or added or moved):
            return None
        return BatchUpdate(batch_size=len(states), removed=removed, added=added, moved=moved)
