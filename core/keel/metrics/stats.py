"""Per-iteration request statistics (TTFT, inter-token latency, end-to-end latency, finishes).

The engine core counts tokens, blocks and preemptions (`SchedulerStats`); latencies are measured in
the front end, where requests arrive and their outputs leave, as vLLM v1 does. `AsyncLLM` feeds a
`RequestStatsTracker` and hands each iteration's `IterationStats` to its stat loggers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from keel.engine.core_output import EngineCoreOutput, SchedulerStats


@dataclass
class IterationStats:
    """What happened to requests during one engine iteration, in seconds.

    `time_to_first_tokens` and `inter_token_latencies` have one entry per engine request (one per
    sample when n > 1) that produced tokens; `e2e_latencies` and `finished_reasons` one per finished
    engine request. Client aborts appear as finish reason "abort" with no e2e latency.
    """

    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    e2e_latencies: list[float] = field(default_factory=list)
    finished_reasons: list[str] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.time_to_first_tokens or self.inter_token_latencies or self.finished_reasons)


@runtime_checkable
class StatLogger(Protocol):
    """Receives engine statistics. Called by `AsyncLLM` on its event loop after every engine
    iteration message; must be fast and must never raise."""

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        ...


@dataclass
class _Timing:
    arrival: float
    last_token: float | None = None


class RequestStatsTracker:
    """Tracks arrival and token times of engine requests (children of an n > 1 request separately).

    All methods are called by the front end on one thread, with `time.monotonic()` timestamps.
    """

    def __init__(self) -> None:
        self._timings: dict[str, _Timing] = {}
        self._iteration = IterationStats()

    def __len__(self) -> int:
        return len(self._timings)

    def add(self, engine_request_ids: Iterable[str], arrival: float) -> None:
        for rid in engine_request_ids:
            self._timings[rid] = _Timing(arrival)

    def observe_outputs(self, outputs: Iterable[EngineCoreOutput], now: float) -> None:
        """A step's core outputs: first tokens give TTFT, later ones inter-token latency."""
        for out in outputs:
            t = self._timings.get(out.request_id)
            if t is None or not out.new_token_ids:
                continue
            if t.last_token is None:
                self._iteration.time_to_first_tokens.append(now - t.arrival)
            else:
                self._iteration.inter_token_latencies.append(now - t.last_token)
            t.last_token = now

    def finish(self, engine_request_id: str, reason: str, now: float) -> None:
        """A request ended (stop, length, or abort by the client); forget it."""
        t = self._timings.pop(engine_request_id, None)
        if t is None:
            return
        self._iteration.finished_reasons.append(reason)
        if reason != "abort":
            self._iteration.e2e_latencies.append(now - t.arrival)

    def take(self) -> IterationStats:
        """The stats gathered since the last call."""
        out, self._iteration = self._iteration, IterationStats()
        return out
