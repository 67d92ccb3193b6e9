"""The Prometheus logger exports the speculative-decoding counters under vLLM's names (keel: prefix)."""

from __future__ import annotations

import pytest

from keel.engine.core_output import SchedulerStats

prometheus = pytest.importorskip("keel_endpoints.prometheus")


def test_spec_decode_counters_exported():
    logger = prometheus.PrometheusStatLogger("m")
    text = logger.render().decode()
    assert 'keel:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 0.0' in text
    assert "# TYPE keel:spec_decode_num_accepted_tokens_total counter" in text
    logger.record(SchedulerStats(spec_decode_num_draft_tokens_total=12, spec_decode_num_accepted_tokens_total=5),
                  None)
    text = logger.render().decode()
    assert 'keel:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 12.0' in text
    assert 'keel:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 5.0' in text
