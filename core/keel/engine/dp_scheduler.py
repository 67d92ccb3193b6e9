"""DataParallelScheduler: one Scheduler (and KV cache) per data-parallel rank, behind the Scheduler's face.

Built by the `EngineCore` when `data_parallel_size > 1`; the core calls it exactly as it calls a
`Scheduler`. Each DP rank is an engine replica of its own -- its requests, its block pool, its
preemptions and prefix cache -- the way vLLM runs one engine core per DP rank, but all replicas step
together in one loop: `schedule()` asks every rank's scheduler and returns their outputs side by side
(`DataParallelSchedulerOutput`), the executor hands each DP group its part, and `update_from_output`
gives each scheduler its group's `ModelRunnerOutput` back. Stepping together is what the attention-DP
layout of a MoE model needs (every rank joins the experts' collectives each step, see
`ForwardContext.dp_num_tokens`); dense replicas simply never talk to each other.

A request goes to the rank with the fewest unfinished requests (ties: the lowest rank) and stays there.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence

from keel.engine.core_output import EngineCoreOutput, SchedulerStats
from keel.engine.request import EngineCoreRequest
from keel.engine.scheduler import Scheduler
from keel.engine.scheduler_output import DataParallelRunnerOutput, DataParallelSchedulerOutput


class DataParallelScheduler:
    def __init__(self, schedulers: Sequence[Scheduler]) -> None:
        if len(schedulers) < 2:
            raise ValueError("a DataParallelScheduler needs a scheduler per data-parallel rank (at least 2)")
        self.schedulers = list(schedulers)
        self._rank_of: dict[str, int] = {}  # unfinished request id -> its DP rank

    def add_request(self, req: EngineCoreRequest, max_tokens: int) -> None:
        if req.request_id in self._rank_of:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        rank = min(range(len(self.schedulers)), key=lambda r: self.schedulers[r].get_num_unfinished_requests())
        self.schedulers[rank].add_request(req, max_tokens)
        self._rank_of[req.request_id] = rank

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            if rid in self._rank_of:
                by_rank.setdefault(self._rank_of[rid], []).append(rid)
        outputs = [out for rank, ids in by_rank.items() for out in self.schedulers[rank].abort_requests(ids)]
        self._forget_finished(outputs)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.schedulers)

    def get_num_unfinished_requests(self) -> int:
        return sum(s.get_num_unfinished_requests() for s in self.schedulers)

    def schedule(self) -> DataParallelSchedulerOutput:
        parts = [s.schedule() for s in self.schedulers]
        counts = tuple(p.total_num_scheduled_tokens for p in parts)
        return DataParallelSchedulerOutput(tuple(dataclasses.replace(p, dp_num_tokens=counts) for p in parts))

    def update_from_output(self, scheduler_output: DataParallelSchedulerOutput,
                           runner_output: DataParallelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        for s, part, out in zip(self.schedulers, scheduler_output.parts, runner_output.outputs, strict=True):
            outputs += s.update_from_output(part, out)
        self._forget_finished(outputs)
        return outputs

    def _forget_finished(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            if out.finish_reason is not None:
                self._rank_of.pop(out.request_id, None)

    def make_stats(self) -> SchedulerStats:
        """Counters summed over the replicas (per-key for dicts, per-position for lists); KV cache usage
        is their mean (every pool has the same size)."""
        stats = [s.make_stats() for s in self.schedulers]
        total = SchedulerStats()
        for field in dataclasses.fields(SchedulerStats):
            values = [getattr(s, field.name) for s in stats]
            if field.name == "kv_cache_usage":
                merged = sum(values) / len(values)
            elif isinstance(values[0], dict):
                merged = {}
                for v in values:
                    for key, n in v.items():
                        merged[key] = merged.get(key, 0) + n
            elif isinstance(values[0], list):
                merged = [sum(col) for col in itertools.zip_longest(*values, fillvalue=0)]
            else:
                merged = sum(values)
            setattr(total, field.name, merged)
        return total
