"""Request latency tracking and the Prometheus stat logger, without a server."""

from __future__ import annotations

import pytest

from keel.engine.core_output import EngineCoreOutput, SchedulerStats
from keel.metrics.stats import IterationStats, RequestStatsTracker, StatLogger

prometheus = pytest.importorskip("keel_endpoints.prometheus")


def test_tracker_ttft_itl_e2e_and_aborts():
    t = RequestStatsTracker()
    t.add(["a", "b"], arrival=10.0)
    t.observe_outputs([EngineCoreOutput("a", [1]), EngineCoreOutput("b", []), EngineCoreOutput("x", [1])], 10.5)
    t.observe_outputs([EngineCoreOutput("a", [2]), EngineCoreOutput("b", [3])], 10.75)
    t.finish("a", "length", 11.0)
    t.finish("b", "abort", 11.0)
    t.finish("a", "stop", 12.0)  # already forgotten: ignored
    s = t.take()
    assert s.time_to_first_tokens == [0.5, 0.75] and s.inter_token_latencies == [0.25]
    assert s.e2e_latencies == [1.0] and s.finished_reasons == ["length", "abort"]
    assert t.take().empty() and len(t) == 0


def test_prometheus_logger_names_values_and_isolation():
    a = prometheus.PrometheusStatLogger("model-a")
    b = prometheus.PrometheusStatLogger("model-b")  # its own registry: no duplicate-metric clash
    assert isinstance(a, StatLogger)
    a.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25, prompt_tokens_total=40,
                            generation_tokens_total=7, num_preemptions_total=1, prefix_cache_queries_total=40,
                            prefix_cache_hits_total=16),
             IterationStats([0.02], [0.01, 0.03], [0.5], ["stop", "length", "abort"]))
    text = a.render().decode()
    for line in ('keel:num_requests_running{engine="0",model_name="model-a"} 3.0',
                 'keel:num_requests_waiting{engine="0",model_name="model-a"} 2.0',
                 'keel:kv_cache_usage_perc{engine="0",model_name="model-a"} 0.25',
                 'keel:prompt_tokens_total{engine="0",model_name="model-a"} 40.0',
                 'keel:generation_tokens_total{engine="0",model_name="model-a"} 7.0',
                 'keel:num_preemptions_total{engine="0",model_name="model-a"} 1.0',
                 'keel:prefix_cache_queries_total{engine="0",model_name="model-a"} 40.0',
                 'keel:prefix_cache_hits_total{engine="0",model_name="model-a"} 16.0',
                 'keel:request_success_total{engine="0",finished_reason="stop",model_name="model-a"} 1.0',
                 'keel:request_success_total{engine="0",finished_reason="length",model_name="model-a"} 1.0',
                 'keel:time_to_first_token_seconds_count{engine="0",model_name="model-a"} 1.0',
                 'keel:inter_token_latency_seconds_count{engine="0",model_name="model-a"} 2.0',
                 'keel:e2e_request_latency_seconds_count{engine="0",model_name="model-a"} 1.0'):
        assert line in text, line
    # vLLM's FinishReason labels, aborts included (they are finished requests; no latency is recorded)
    assert 'keel:request_success_total{engine="0",finished_reason="abort",model_name="model-a"} 1.0' in text
    assert 'keel:request_success_total{engine="0",finished_reason="error",model_name="model-a"} 0.0' in text
    assert "# TYPE keel:time_to_first_token_seconds histogram" in text
    assert 'keel:num_requests_running{engine="0",model_name="model-b"} 0.0' in b.render().decode()


def test_prometheus_logger_is_a_stat_logger_plugin():
    from keel.metrics.stats import StatLogger
    from keel.plugins.loader import load_plugins

    registry = load_plugins(["endpoints"]).registry("stat_logger")
    assert registry.provider("prometheus").plugin == "endpoints"
    logger_cls = registry.get("prometheus")
    assert logger_cls is prometheus.PrometheusStatLogger
    assert isinstance(logger_cls("m"), StatLogger)
