"""Prometheus metrics with vLLM's names under the `keel:` prefix (`vllm:kv_cache_usage_perc` ->
`keel:kv_cache_usage_perc`), in a registry of their own so that several servers in one process (tests)
never clash.

Gauges and counters are read from the latest `SchedulerStats` snapshot at scrape time (the engine core
keeps the running totals); histograms and `request_success_total` are fed from `IterationStats`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from keel.engine.core_output import SchedulerStats
from keel.metrics.stats import IterationStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets as vLLM's, trimmed to what a single server sees.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0)

# (name without _total, SchedulerStats field, help)
_GAUGES = (
    ("keel:num_requests_running", "num_running_reqs", "Number of requests in model execution batches."),
    ("keel:num_requests_waiting", "num_waiting_reqs", "Number of requests waiting to be processed."),
    ("keel:kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
)
_COUNTERS = (
    ("keel:prompt_tokens", "prompt_tokens_total", "Number of prefill tokens processed."),
    ("keel:generation_tokens", "generation_tokens_total", "Number of generation tokens processed."),
    ("keel:num_preemptions", "num_preemptions_total", "Cumulative number of preemptions."),
    ("keel:prefix_cache_queries", "prefix_cache_queries_total",
     "Prefix cache queries, in terms of number of queried tokens."),
    ("keel:prefix_cache_hits", "prefix_cache_hits_total",
     "Prefix cache hits, in terms of number of cached tokens."),
    ("keel:spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens_total",
     "Number of speculative draft tokens proposed and verified."),
    ("keel:spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_total",
     "Number of speculative draft tokens accepted."),
)


class _SnapshotCollector(Collector):
    def __init__(self, logger: PrometheusStatLogger) -> None:
        self.logger = logger

    def collect(self) -> Iterator[Any]:
        stats, success = self.logger.snapshot()
        labels = ["model_name"]
        value = [self.logger.model_name]
        for name, attr, doc in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, float(getattr(stats, attr)))
            yield g
        for name, attr, doc in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, float(getattr(stats, attr)))
            yield c
        c = CounterMetricFamily("keel:request_success", "Count of successfully processed requests.",
                                labels=[*labels, "finished_reason"])
        for reason in sorted(set(success) | {"stop", "length"}):
            c.add_metric([*value, reason], float(success.get(reason, 0)))
        yield c


class PrometheusStatLogger:
    """A `StatLogger` exposing the engine's metrics in Prometheus text format.

    Created by the API server and handed to the engine client (`AsyncLLM.add_stat_logger`); `record`
    runs on the engine client's event loop, `render` on any thread (a scrape).
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._stats = SchedulerStats()
        self._success: dict[str, int] = {}
        self.registry.register(_SnapshotCollector(self))
        labels = ["model_name"]
        self.ttft = Histogram("keel:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("keel:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("keel:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.",
                             labels, buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        with self._lock:
            if scheduler_stats is not None:
                self._stats = scheduler_stats
            if iteration_stats is not None:
                for reason in iteration_stats.finished_reasons:
                    if reason != "abort":
                        self._success[reason] = self._success.get(reason, 0) + 1
        if iteration_stats is not None:
            for v in iteration_stats.time_to_first_tokens:
                self.ttft.observe(v)
            for v in iteration_stats.inter_token_latencies:
                self.itl.observe(v)
            for v in iteration_stats.e2e_latencies:
                self.e2e.observe(v)

    def snapshot(self) -> tuple[SchedulerStats, dict[str, int]]:
        with self._lock:
            return self._stats, dict(self._success)

    def render(self) -> bytes:
        """The metrics in Prometheus text exposition format (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)
