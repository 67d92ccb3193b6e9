"""What the engine core reports per request per step, and its counters. Plain data: it crosses the
engine-client boundary, so it may be serialized when the core moves to its own process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    # Per new token: (token ids, logprobs, ranks), column 0 the sampled token. None if not requested.
    new_logprobs: tuple[list[list[int]], list[list[float]], list[list[int]]] | None = None
    # (first position, token ids, logprobs, ranks) per prompt position computed this step; column 0 is
    # the actual next prompt token. Positions may repeat after preemption: keep the first.
    new_prompt_logprobs: tuple[int, list[list[int]], list[list[float]], list[list[int]]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # On the output carrying a request's first token: when the scheduler first admitted it (monotonic
    # clock); the front end derives queue and prefill times from it.
    first_scheduled_time: float | None = None
    pooling_output: list[float] | None = None  # a pooling request's vector (it finishes with it)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_waiting_deferred: int = 0  # of num_waiting_reqs, those held by a transient constraint (a grammar compiling)
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    prompt_tokens_total: int = 0
    # Of prompt_tokens_total, those served from the prefix cache (counted when the first token comes).
    prompt_tokens_cached_total: int = 0
    generation_tokens_total: int = 0
    num_finished_total: dict[str, int] = field(default_factory=dict)
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_num_drafts_total: int = 0  # verify steps of a request that carried drafts
    # accepted drafts per draft position (index 0: the first draft token)
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def as_metrics(self) -> dict[str, Any]:
        """The `get_metrics()` dict of LLM / AsyncLLM (vLLM-style names, no prefix)."""
        return {
            "num_requests_running": self.num_running_reqs,
            "num_requests_waiting": self.num_waiting_reqs,
            "kv_cache_usage": self.kv_cache_usage,
            "num_preemptions_total": self.num_preemptions_total,
            "prefix_cache_queries_total": self.prefix_cache_queries_total,
            "prefix_cache_hits_total": self.prefix_cache_hits_total,
            "prompt_tokens_total": self.prompt_tokens_total,
            "prompt_tokens_cached_total": self.prompt_tokens_cached_total,
            "generation_tokens_total": self.generation_tokens_total,
            "request_success_total": dict(self.num_finished_total),
            "spec_decode_num_draft_tokens_total": self.spec_decode_num_draft_tokens_total,
            "spec_decode_num_accepted_tokens_total": self.spec_decode_num_accepted_tokens_total,
            "spec_decode_num_drafts_total": self.spec_decode_num_drafts_total,
            "spec_decode_num_accepted_tokens_per_pos": list(self.spec_decode_num_accepted_tokens_per_pos),
        }
