"""Prometheus metrics with vLLM v1's names, labels and buckets, under the `keel:` prefix -- or `vllm:`
(`keel serve --metrics-prefix vllm`) so that dashboards built for vLLM work unchanged. Each logger has
a registry of its own, so several servers in one process (tests) never clash.

Every series carries vLLM's labels `model_name` and `engine` (keel runs one engine core: "0").
Gauges and counters are read from the latest `SchedulerStats` snapshot at scrape time (the engine core
keeps the running totals); histograms and `request_success` are fed from `IterationStats`.
Of vLLM's metrics, those for features keel lacks are not published (LoRA, KV-block residency sampling,
KV offload, MFU estimates, NaN checks of logits); the endpoints plugin's test_vllm_metric_names lists them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from keel.engine.core_output import SchedulerStats
from keel.metrics.stats import IterationStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIXES = ("keel", "vllm")
ENGINE = "0"

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason values
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


# (name, SchedulerStats field, help)
_GAUGES = (
    ("num_requests_running", "num_running_reqs", "Number of requests in model execution batches."),
    ("num_requests_waiting", "num_waiting_reqs", "Number of requests waiting to be processed."),
    ("kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
)
# (name without _total, SchedulerStats field or None for a true zero, help)
_COUNTERS = (
    ("prompt_tokens", "prompt_tokens_total", "Number of prefill tokens processed."),
    ("prompt_tokens_cached", "prompt_tokens_cached_total", "Number of cached prompt tokens (local + external)."),
    ("generation_tokens", "generation_tokens_total", "Number of generation tokens processed."),
    ("num_preemptions", "num_preemptions_total", "Cumulative number of preemption from the engine."),
    ("prefix_cache_queries", "prefix_cache_queries_total",
     "Prefix cache queries, in terms of number of queried tokens."),
    ("prefix_cache_hits", "prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens."),
    # keel has no KV connector and no multi-modal inputs yet: these are zero, not unmeasured.
    ("external_prefix_cache_queries", None, ("External prefix cache queries from KV connector cross-instance "
                                             "cache sharing, in terms of number of queried tokens.")),
    ("external_prefix_cache_hits", None, ("External prefix cache hits from KV connector cross-instance cache "
                                          "sharing, in terms of number of cached tokens.")),
    ("mm_cache_queries", None, "Multi-modal cache queries, in terms of number of queried items."),
    ("mm_cache_hits", None, "Multi-modal cache hits, in terms of number of cached items."),
    ("spec_decode_num_drafts", "spec_decode_num_drafts_total", "Number of spec decoding drafts."),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens_total", "Number of draft tokens."),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_total", "Number of accepted tokens."),
)


class _SnapshotCollector(Collector):
    def __init__(self, logger: PrometheusStatLogger) -> None:
        self.logger = logger

    def collect(self) -> Iterator[Any]:
        lg = self.logger
        stats, success = lg.snapshot()
        p, labels, value = lg.prefix, ["model_name", "engine"], [lg.model_name, ENGINE]
        for name, attr, doc in _GAUGES:
            g = GaugeMetricFamily(f"{p}:{name}", doc, labels=labels)
            g.add_metric(value, float(getattr(stats, attr)))
            yield g
        g = GaugeMetricFamily(f"{p}:num_requests_waiting_by_reason", "Number of waiting requests by reason "
                              "('capacity': waiting for scheduling capacity; 'deferred': by transient constraints).",
                              labels=[*labels, "reason"])
        g.add_metric([*value, "capacity"], float(stats.num_waiting_reqs - stats.num_waiting_deferred))
        g.add_metric([*value, "deferred"], float(stats.num_waiting_deferred))
        yield g
        g = GaugeMetricFamily(f"{p}:engine_sleep_state", "Engine sleep state; the active state is 1.",
                              labels=[*labels, "sleep_state"])
        for i, state in enumerate(SLEEP_STATES):
            g.add_metric([*value, state], float(i == lg.sleep_level))
        yield g
        if lg.cache_info:
            keys = sorted(lg.cache_info)
            g = GaugeMetricFamily(f"{p}:cache_config_info", "Information of the LLMEngine CacheConfig",
                                  labels=[*keys, "engine"])
            g.add_metric([str(lg.cache_info[k]) for k in keys] + [ENGINE], 1.0)
            yield g
        for name, attr, doc in _COUNTERS:
            c = CounterMetricFamily(f"{p}:{name}", doc, labels=labels)
            c.add_metric(value, float(getattr(stats, attr)) if attr else 0.0)
            yield c
        cached = stats.prompt_tokens_cached_total
        c = CounterMetricFamily(f"{p}:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                labels=[*labels, "source"])
        for source, n in zip(PROMPT_SOURCES, (stats.prompt_tokens_total - cached, cached, 0)):
            c.add_metric([*value, source], float(n))
        yield c
        c = CounterMetricFamily(f"{p}:spec_decode_num_accepted_tokens_per_pos",
                                "Accepted tokens per draft position.", labels=[*labels, "position"])
        for pos, n in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            c.add_metric([*value, str(pos)], float(n))
        yield c
        c = CounterMetricFamily(f"{p}:request_success", "Count of successfully processed requests.",
                                labels=[*labels, "finished_reason"])
        for reason in sorted(set(success) | set(FINISH_REASONS)):
            c.add_metric([*value, reason], float(success.get(reason, 0)))
        yield c


class PrometheusStatLogger:
    """A `StatLogger` exposing the engine's metrics in Prometheus text format.

    Created by the API server and handed to the engine client (`AsyncLLM.add_stat_logger`); `record`
    runs on the engine client's event loop, `render` on any thread (a scrape). `max_model_len` bounds
    the token-count buckets as in vLLM; `cache_info` (label -> value) becomes `cache_config_info`.
    """

    def __init__(self, model_name: str, *, prefix: str = "keel", max_model_len: int = 8192,
                 cache_info: Mapping[str, Any] | None = None) -> None:
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix {prefix!r} is not one of {', '.join(PREFIXES)}")
        self.model_name = model_name
        self.prefix = prefix
        self.cache_info = dict(cache_info or {})
        self.sleep_level = 0  # index into SLEEP_STATES; an engine client that sleeps sets it
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._stats = SchedulerStats()
        self._success: dict[str, int] = {}
        self.registry.register(_SnapshotCollector(self))
        tokens = build_1_2_5_buckets(max_model_len)

        def hist(name: str, doc: str, buckets: Any) -> Any:
            return Histogram(f"{prefix}:{name}", doc, ["model_name", "engine"], buckets=buckets,
                             registry=self.registry).labels(model_name, ENGINE)

        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.phases = {
            phase: hist(f"request_{phase}_time_seconds", f"Histogram of time spent in {label} phase for request.",
                        REQUEST_LATENCY_BUCKETS)
            for phase, label in (("queue", "WAITING"), ("prefill", "PREFILL"), ("decode", "DECODE"),
                                 ("inference", "RUNNING"))
        }
        self.prompt_tokens = hist("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens = hist("request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.prefill_kv_computed = hist("request_prefill_kv_computed_tokens", "Histogram of new KV tokens "
                                        "computed during prefill (excluding cached tokens).", tokens)
        self.max_tokens = hist("request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens)
        self.max_generation = hist("request_max_num_generation_tokens",
                                   "Histogram of maximum number of requested generation tokens.", tokens)
        self.n = hist("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.iteration_tokens = hist("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     ITERATION_TOKEN_BUCKETS)

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        with self._lock:
            if scheduler_stats is not None:
                self._stats = scheduler_stats
            if iteration_stats is not None:
                for reason in iteration_stats.finished_reasons:
                    self._success[reason] = self._success.get(reason, 0) + 1
        it = iteration_stats
        if it is None:
            return
        for hist, values in ((self.ttft, it.time_to_first_tokens), (self.itl, it.inter_token_latencies),
                             (self.e2e, it.e2e_latencies), (self.n, it.n_params),
                             (self.max_generation, it.max_num_generation_tokens)):
            for v in values:
                hist.observe(v)
        if it.num_prompt_tokens or it.num_generation_tokens:
            self.iteration_tokens.observe(it.num_prompt_tokens + it.num_generation_tokens)
        for r in it.finished_requests:
            self.phases["queue"].observe(r.queued_time)
            self.phases["prefill"].observe(r.prefill_time)
            self.phases["decode"].observe(r.decode_time)
            self.phases["inference"].observe(r.inference_time)
            if r.num_generation_tokens > 1:
                self.tpot.observe(r.mean_time_per_output_token)
            self.prompt_tokens.observe(r.num_prompt_tokens)
            self.generation_tokens.observe(r.num_generation_tokens)
            self.prefill_kv_computed.observe(max(r.num_prompt_tokens - r.num_cached_tokens, 0))
            if r.max_tokens_param:
                self.max_tokens.observe(r.max_tokens_param)

    def snapshot(self) -> tuple[SchedulerStats, dict[str, int]]:
        with self._lock:
            return self._stats, dict(self._success)

    def render(self) -> bytes:
        """The metrics in Prometheus text exposition format (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)
