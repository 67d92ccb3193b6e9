"""Per-iteration request statistics (TTFT, inter-token latency, request phases, finishes).

The engine core counts tokens, blocks and preemptions (`SchedulerStats`) and stamps when a request was
first scheduled; latencies are measured in the front end, where requests arrive and their outputs
leave, as vLLM v1 does. `AsyncLLM` feeds a `RequestStatsTracker` and hands each iteration's
`IterationStats` to its stat loggers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from keel.engine.core_output import EngineCoreOutput, SchedulerStats


@dataclass
class FinishedRequestStats:
    """One engine request (one sample of an n > 1 request) that ended other than by an abort; seconds.

    Phases as vLLM defines them: queued = arrival -> first scheduled, prefill = first scheduled -> first
    token, decode = first token -> last token, inference = prefill + decode.
    """

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    max_tokens_param: int | None
    queued_time: float
    prefill_time: float
    decode_time: float
    inference_time: float
    mean_time_per_output_token: float


@dataclass
class IterationStats:
    """What happened to requests during one engine iteration, in seconds.

    `time_to_first_tokens` and `inter_token_latencies` have one entry per engine request (one per
    sample when n > 1) that produced tokens; `e2e_latencies` and `finished_requests` one per engine
    request that finished (not aborted), `finished_reasons` one per engine request that ended, client
    aborts included (reason "abort"). `n_params` and `max_num_generation_tokens` have one entry per
    finished user request (its `n`, and the longest of its completions).
    """

    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    e2e_latencies: list[float] = field(default_factory=list)
    finished_reasons: list[str] = field(default_factory=list)
    num_prompt_tokens: int = 0  # prompts whose first token came this iteration
    num_generation_tokens: int = 0
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.time_to_first_tokens or self.inter_token_latencies or self.finished_reasons
                    or self.n_params)


@runtime_checkable
class StatLogger(Protocol):
    """Receives engine statistics. Called by `AsyncLLM` on its event loop after every engine
    iteration message; must be fast and must never raise."""

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        ...


@dataclass
class _Timing:
    arrival: float
    num_prompt_tokens: int = 0
    max_tokens: int | None = None
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0


class RequestStatsTracker:
    """Tracks arrival and token times of engine requests (children of an n > 1 request separately).

    All methods are called by the front end on one thread, with `time.monotonic()` timestamps (the
    engine core's `first_scheduled_time` uses the same clock, also from its own process).
    """

    def __init__(self) -> None:
        self._timings: dict[str, _Timing] = {}
        self._iteration = IterationStats()

    def __len__(self) -> int:
        return len(self._timings)

    def add(self, engine_request_ids: Iterable[str], arrival: float, *, num_prompt_tokens: int = 0,
            max_tokens: int | None = None) -> None:
        for rid in engine_request_ids:
            self._timings[rid] = _Timing(arrival, num_prompt_tokens, max_tokens)

    def observe_outputs(self, outputs: Iterable[EngineCoreOutput], now: float) -> None:
        """A step's core outputs: first tokens give TTFT, later ones inter-token latency."""
        it = self._iteration
        for out in outputs:
            t = self._timings.get(out.request_id)
            if t is None or not out.new_token_ids:
                continue
            if out.first_scheduled_time is not None and t.scheduled is None:
                t.scheduled = out.first_scheduled_time
            if t.first_token is None:
                it.time_to_first_tokens.append(now - t.arrival)
                it.num_prompt_tokens += t.num_prompt_tokens
                t.first_token = now
                t.num_cached_tokens = out.num_cached_tokens
            else:
                it.inter_token_latencies.append(now - t.last_token)  # type: ignore[operator]
            t.last_token = now
            t.num_generation_tokens += len(out.new_token_ids)
            it.num_generation_tokens += len(out.new_token_ids)

    def finish(self, engine_request_id: str, reason: str, now: float) -> int:
        """A request ended (stop, length, or abort by the client); forget it. Returns its number of
        generated tokens (0 for an unknown id)."""
        t = self._timings.pop(engine_request_id, None)
        if t is None:
            return 0
        it = self._iteration
        it.finished_reasons.append(reason)
        if reason == "abort":
            return t.num_generation_tokens
        it.e2e_latencies.append(now - t.arrival)
        first = t.first_token if t.first_token is not None else now
        last = t.last_token if t.last_token is not None else now
        scheduled = min(t.scheduled if t.scheduled is not None else t.arrival, first)
        decode = last - first
        it.finished_requests.append(FinishedRequestStats(
            finish_reason=reason, e2e_latency=now - t.arrival, num_prompt_tokens=t.num_prompt_tokens,
            num_generation_tokens=t.num_generation_tokens, num_cached_tokens=t.num_cached_tokens,
            max_tokens_param=t.max_tokens, queued_time=max(scheduled - t.arrival, 0.0),
            prefill_time=first - scheduled, decode_time=decode, inference_time=last - scheduled,
            mean_time_per_output_token=decode / (t.num_generation_tokens - 1) if t.num_generation_tokens > 1 else 0.0,
        ))
        return t.num_generation_tokens

    def finish_parent(self, n: int, max_num_generation_tokens: int) -> None:
        """A user request's last completion ended (after `finish` of its engine requests)."""
        self._iteration.n_params.append(n)
        self._iteration.max_num_generation_tokens.append(max_num_generation_tokens)

    def take(self) -> IterationStats:
        """The stats gathered since the last call."""
        out, self._iteration = self._iteration, IterationStats()
        return out
