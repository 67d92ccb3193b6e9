"""The engine core's view of one request: token ids, progress, and how it ended.

`num_computed_tokens` catches up to `num_tokens` (prompt + committed outputs); the scheduler advances it
when it schedules tokens and lowers it when speculative tokens are rejected or the request is preempted.
Speculative draft tokens live in `spec_token_ids`, outside `all_token_ids`, so they are never hashed
into the prefix cache.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from keel.engine.pooling_params import PoolingParams
from keel.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from keel.structured_output.manager import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class EngineCoreRequest:
    """What the front end hands the engine core: already tokenized and validated."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    seed: int  # sampling seed: the user's (derived per child when n > 1) or drawn by the front end
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    priority: int = 0  # under the "priority" scheduling policy: lower is scheduled sooner
    # A pooling (embedding) request: computes its prompt and returns one vector, samples nothing.
    pooling_params: PoolingParams | None = None


class Request:
    def __init__(self, req: EngineCoreRequest, max_tokens: int) -> None:
        self.request_id = req.request_id
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.sampling_params = req.sampling_params
        self.eos_token_id = req.eos_token_id
        self.seed = req.seed
        self.arrival_time = req.arrival_time
        self.cache_salt = req.cache_salt
        self.priority = req.priority
        self.pooling_params = req.pooling_params
        self.max_tokens = max_tokens  # resolved against max_model_len by the front end

        self.all_token_ids: list[int] = list(req.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.spec_token_ids: list[int] = []
        # Async scheduling: tokens being sampled by steps still in flight (scheduled, values unknown).
        self.num_output_placeholders = 0
        self.num_computed_tokens = 0
        self.block_hashes: list = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first scheduling
        self.first_scheduled_time: float | None = None
        # Structured outputs: the constraint's compile, then its grammar (set by the scheduler).
        self.structured_output: StructuredOutputRequest | None = None

    @property
    def priority_key(self) -> tuple[int, float]:
        """The "priority" policy's order: priority, then arrival (smaller first)."""
        return (self.priority, self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
