"""The runner's own mirror of a request. The runner never reads or writes scheduler state; it learns
everything from SchedulerOutput and appends the tokens it sampled itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from keel.engine.pooling_params import PoolingParams
from keel.engine.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + outputs sampled so far (no drafts)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int
    block_ids: list[int]
    num_computed_tokens: int
    stop_token_ids: frozenset[int]
    row: int = -1  # the request's row in the runner's InputBatch
    pooling_params: PoolingParams | None = None
    pooled_hidden: list[Any] = field(default_factory=list)  # a pooling request's prompt hidden states so far

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
