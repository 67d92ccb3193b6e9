"""/metrics publishes vLLM v1's metrics: the same names, labels and buckets, under `keel:` or, with
`--metrics-prefix vllm`, under vLLM's own prefix."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient
from keel_endpoints.options import ServerConfig
from keel_endpoints.prometheus import PrometheusStatLogger, build_1_2_5_buckets
from keel_endpoints.server import build_app
from keel_endpoints.testing import StubConfig, StubEngine

from keel.engine.core_output import EngineCoreOutput, SchedulerStats
from keel.metrics.stats import RequestStatsTracker
from keel.plugins.loader import load_plugins
from keel.testing.tokenizer import build_tokenizer

# vLLM v1's Prometheus metrics (vllm/v1/metrics/loggers.py, spec_decode/metrics.py; docs/usage/metrics.md
# of vLLM 0.2x-0.3x), without the `vllm:` prefix; counters without their `_total` suffix.
VLLM_METRICS = {
    # scheduler state and engine
    "num_requests_running": "gauge", "num_requests_waiting": "gauge", "num_requests_waiting_by_reason": "gauge",
    "engine_sleep_state": "gauge", "kv_cache_usage_perc": "gauge", "cache_config_info": "gauge",
    "lora_requests_info": "gauge",
    # counters
    "prefix_cache_queries": "counter", "prefix_cache_hits": "counter", "external_prefix_cache_queries": "counter",
    "external_prefix_cache_hits": "counter", "mm_cache_queries": "counter", "mm_cache_hits": "counter",
    "corrupted_requests": "counter", "num_preemptions": "counter", "prompt_tokens": "counter",
    "prompt_tokens_by_source": "counter", "prompt_tokens_cached": "counter", "generation_tokens": "counter",
    "request_success": "counter",
    # histograms
    "request_prompt_tokens": "histogram", "request_generation_tokens": "histogram",
    "iteration_tokens_total": "histogram", "request_max_num_generation_tokens": "histogram",
    "request_params_n": "histogram", "request_params_max_tokens": "histogram",
    "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram", "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram", "request_inference_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram", "request_decode_time_seconds": "histogram",
    "request_prefill_kv_computed_tokens": "histogram",
    # speculative decoding
    "spec_decode_num_drafts": "counter", "spec_decode_num_draft_tokens": "counter",
    "spec_decode_num_accepted_tokens": "counter", "spec_decode_num_accepted_tokens_per_pos": "counter",
    # optional in vLLM too (--kv-cache-metrics, a KV connector, --enable-mfu-metrics)
    "kv_block_lifetime_seconds": "histogram", "kv_block_idle_before_evict_seconds": "histogram",
    "kv_block_reuse_gap_seconds": "histogram", "kv_offload_size": "histogram", "kv_offload_total_bytes": "counter",
    "kv_offload_total_time": "counter", "estimated_flops_per_gpu_total": "counter",
    "estimated_read_bytes_per_gpu_total": "counter", "estimated_write_bytes_per_gpu_total": "counter",
}
# What keel does not publish, and why (the README's metrics row says the same).
NOT_PUBLISHED = {
    "lora_requests_info": "no LoRA",
    "corrupted_requests": "logits are not checked for NaNs (vLLM: only with VLLM_COMPUTE_NANS_IN_LOGITS)",
    "kv_block_lifetime_seconds": "no KV-block residency sampling (vLLM: --kv-cache-metrics)",
    "kv_block_idle_before_evict_seconds": "no KV-block residency sampling",
    "kv_block_reuse_gap_seconds": "no KV-block residency sampling",
    "kv_offload_size": "no KV offloading connector", "kv_offload_total_bytes": "no KV offloading connector",
    "kv_offload_total_time": "no KV offloading connector",
    "estimated_flops_per_gpu_total": "no MFU estimates (vLLM: --enable-mfu-metrics)",
    "estimated_read_bytes_per_gpu_total": "no MFU estimates", "estimated_write_bytes_per_gpu_total": "no MFU estimates",
}

_TYPE = re.compile(r"^# TYPE (\w+):(\w+) (\w+)$", re.MULTILINE)


def published(text: str, prefix: str) -> dict[str, str]:
    out = {}
    for p, name, kind in _TYPE.findall(text):
        assert p == prefix, name
        if not name.endswith("_created"):
            out[name.removesuffix("_total") if kind == "counter" else name] = kind
    return out


def test_every_vllm_metric_is_published_with_its_type():
    logger = PrometheusStatLogger("m", prefix="vllm", max_model_len=1000, cache_info={"block_size": 16})
    names = published(logger.render().decode(), "vllm")
    expected = {k: v for k, v in VLLM_METRICS.items() if k not in NOT_PUBLISHED}
    assert names == expected
    assert set(NOT_PUBLISHED) <= set(VLLM_METRICS)


def test_labels_and_buckets_are_vllms():
    logger = PrometheusStatLogger("m", prefix="vllm", max_model_len=1000, cache_info={"block_size": 16})
    text = logger.render().decode()
    for line in text.splitlines():
        if line.startswith("vllm:") and not line.startswith("vllm:cache_config_info"):
            assert 'engine="0"' in line and 'model_name="m"' in line, line
    assert 'vllm:cache_config_info{block_size="16",engine="0"} 1.0' in text
    ttft = re.findall(r'vllm:time_to_first_token_seconds_bucket\{engine="0",le="([^"]+)"', text)
    assert ttft[-3:] == ["640.0", "2560.0", "+Inf"] and len(ttft) == 23
    assert build_1_2_5_buckets(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    prompt = re.findall(r'vllm:request_prompt_tokens_bucket\{engine="0",le="([^"]+)"', text)
    assert prompt == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "+Inf"]
    itl = re.findall(r'vllm:inter_token_latency_seconds_bucket\{engine="0",le="([^"]+)"', text)
    assert itl[0] == "0.01" and itl[-2] == "80.0"


def test_request_phases_from_the_core_schedule_time():
    t = RequestStatsTracker()
    t.add(["a"], arrival=10.0, num_prompt_tokens=8, max_tokens=4)
    t.observe_outputs([EngineCoreOutput("a", [1], num_cached_tokens=4, first_scheduled_time=10.25)], 11.0)
    t.observe_outputs([EngineCoreOutput("a", [2, 3])], 11.5)
    assert t.finish("a", "length", 12.0) == 3
    t.finish_parent(1, 3)
    it = t.take()
    (r,) = it.finished_requests
    assert (r.queued_time, r.prefill_time, r.decode_time, r.inference_time) == (0.25, 0.75, 0.5, 1.25)
    assert r.mean_time_per_output_token == 0.25 and r.num_cached_tokens == 4 and r.max_tokens_param == 4
    assert it.num_prompt_tokens == 8 and it.num_generation_tokens == 3 and it.n_params == [1]

    logger = PrometheusStatLogger("m", max_model_len=64)
    logger.record(SchedulerStats(prompt_tokens_total=8, prompt_tokens_cached_total=4, num_waiting_reqs=3,
                                 num_waiting_deferred=1,
                                 spec_decode_num_accepted_tokens_per_pos=[3, 1]), it)
    text = logger.render().decode()
    for line in ('keel:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.25',
                 'keel:request_prefill_kv_computed_tokens_sum{engine="0",model_name="m"} 4.0',
                 'keel:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 4.0',
                 'keel:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 4.0',
                 'keel:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 1.0',
                 'keel:request_params_max_tokens_count{engine="0",model_name="m"} 1.0',
                 'keel:iteration_tokens_total_sum{engine="0",model_name="m"} 11.0',
                 'keel:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 2.0',
                 'keel:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"} 1.0'):
        assert line in text, line


def test_metrics_prefix_option(tmp_path):
    tok = build_tokenizer(tmp_path)
    plugins = load_plugins(["endpoints", "io-processors"])
    config = ServerConfig.from_plugin_options({"metrics_prefix": "vllm"})
    text = TestClient(build_app(StubEngine(tok), StubConfig, plugin_set=plugins, server_config=config)).get(
        "/metrics").text
    assert 'vllm:num_requests_running{engine="0",model_name="stub"} 0.0' in text and "keel:" not in text
    with pytest.raises(ValueError, match="metrics_prefix"):
        ServerConfig(metrics_prefix="sglang")
