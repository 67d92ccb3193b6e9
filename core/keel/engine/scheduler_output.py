"""Plain data passed from the scheduler to the runner and back. No behaviour, no references to
scheduler state: the runner keeps its own mirror of each request."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from keel.engine.pooling_params import PoolingParams
from keel.engine.sampling_params import SamplingParams
from keel.structured_output.manager import GrammarBitmask


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (the runner dropped it)."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix-cache hit)
    stop_token_ids: frozenset[int]  # eos + stop_token_ids, masked by the sampler until min_tokens
    pooling_params: PoolingParams | None = None  # a pooling request: pooled once its prompt is computed


@dataclass
class CachedRequestData:
    """The running requests the runner already holds: what changed since the last step, one entry per
    request in each list (vLLM's layout: a step of hundreds of decoding requests builds a few lists, not
    an object per request)."""

    req_ids: list[str] = field(default_factory=list)
    # Blocks appended to each request's table this step (empty for most decode steps).
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Pipeline parallelism: per request, the tokens sampled since the runner last saw it (only the last
    # stage samples; the stages before it learn the tokens here). An empty list (no entries) otherwise.
    new_token_ids: list[list[int]] = field(default_factory=list)
    # Async scheduling with speculative decoding: per request, whether its previous sampled step has not
    # been applied yet, so num_computed_tokens counts all of that step's drafts as accepted; the runner
    # corrects it by the step's accepted count (on the device while the step is in flight) and takes the
    # step's bonus token and new drafts (placeholders -1 in scheduled_spec_decode_tokens) from the device.
    after_in_flight_step: list[bool] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens this step (order = batch order)
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Requests the runner must forget: finished, aborted or preempted since the last step.
    finished_req_ids: set[str] = field(default_factory=set)
    # Allowed tokens of the constrained requests that sample this step (structured outputs), or None.
    grammar_bitmask: GrammarBitmask | None = None
    # Under data parallelism: every DP rank's total_num_scheduled_tokens this step, in DP rank order
    # (ranks whose layers gather tokens across DP size their exchange from it; no host sync needed).
    dp_num_tokens: tuple[int, ...] = ()

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True)
class DataParallelSchedulerOutput:
    """One step of every data-parallel replica (`DataParallelScheduler.schedule`): the executor sends
    part d to the ranks of DP group d."""

    parts: tuple[SchedulerOutput, ...]

    @property
    def is_empty(self) -> bool:
        return all(p.is_empty for p in self.parts)


@dataclass
class LogprobsTensors:
    """Per-row logprobs as returned by the sampler; column 0 is the sampled (or actual next) token."""

    token_ids: torch.Tensor  # [rows, k + 1] int64
    logprobs: torch.Tensor  # [rows, k + 1] float32
    ranks: torch.Tensor  # [rows, k + 1] int64


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # batch order
    sampled_token_ids: list[list[int]]  # per request; empty for a prefill chunk that samples nothing
    logprobs: dict[str, tuple[list[list[int]], list[list[float]], list[list[int]]]] = field(
        default_factory=dict
    )  # req_id -> (token ids, logprobs, ranks) per sampled token, lists for the front end
    # req_id -> draft tokens proposed for the next step (speculative decoding)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> drafts actually verified, where fewer than scheduled (placeholders beyond what a host
    # proposer drafted count as rejected); for the draft counters only
    num_verified_drafts: dict[str, int] = field(default_factory=dict)
    # req_id -> (first position, token ids, logprobs, ranks) for the prompt positions computed this
    # step; position p predicts prompt token p + 1. Recomputation after preemption repeats positions.
    prompt_logprobs: dict[str, tuple[int, list[list[int]], list[list[float]], list[list[int]]]] = field(
        default_factory=dict
    )
    # req_id -> the pooled vector of a pooling request whose prompt was completed this step
    pooler_output: dict[str, list[float]] = field(default_factory=dict)


EMPTY_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


@dataclass(frozen=True)
class DataParallelRunnerOutput:
    """Every DP replica's `ModelRunnerOutput` for a `DataParallelSchedulerOutput`, in DP rank order."""

    outputs: tuple[ModelRunnerOutput, ...]
