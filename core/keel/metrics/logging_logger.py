"""The `logging` stat logger: one INFO line of throughput and cache state every interval, as vLLM's
LoggingStatLogger ("Avg prompt throughput: ... tokens/s, ..."). The `keel serve` default; off with
`--disable-log-stats`. Logged to "keel.stats" at INFO whatever `--log-level` says (the logger's own
level is set), since asking for it is the point; idle intervals log nothing.
"""

from __future__ import annotations

import logging
import time

from keel.engine.core_output import SchedulerStats
from keel.metrics.stats import IterationStats

logger = logging.getLogger("keel.stats")

LOG_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL default


class LoggingStatLogger:
    def __init__(self, interval_s: float = LOG_INTERVAL_S, clock=time.monotonic) -> None:
        logger.setLevel(logging.INFO)
        self.interval_s = interval_s
        self._clock = clock
        self._last_time = clock()
        self._last: SchedulerStats | None = None  # the counters at the last line
        self._latest: SchedulerStats | None = None

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self._latest = scheduler_stats
        now = self._clock()
        if now - self._last_time >= self.interval_s and self._latest is not None:
            self.log(now)

    def log(self, now: float) -> None:
        s, last = self._latest, self._last or SchedulerStats()
        elapsed = max(now - self._last_time, 1e-9)
        prompt = (s.prompt_tokens_total - last.prompt_tokens_total) / elapsed
        generation = (s.generation_tokens_total - last.generation_tokens_total) / elapsed
        queries = s.prefix_cache_queries_total - last.prefix_cache_queries_total
        hits = s.prefix_cache_hits_total - last.prefix_cache_hits_total
        self._last, self._last_time = s, now
        if not (prompt or generation or s.num_running_reqs or s.num_waiting_reqs):
            return
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            prompt, generation, s.num_running_reqs, s.num_waiting_reqs, 100 * s.kv_cache_usage,
            100 * hits / queries if queries else 0.0,
        )
