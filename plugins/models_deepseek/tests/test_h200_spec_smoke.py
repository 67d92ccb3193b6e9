"""benchmarks/h200_spec.py --smoke: the MTP-vs-plain benchmark runs end to end on a tiny model (here on
the CPU), its shaped draft agrees with the target, and MTP's greedy tokens equal plain decoding's."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "h200_spec.py"


def test_smoke_run(tmp_path, monkeypatch):
    monkeypatch.setenv("KEEL_PLATFORM", "cpu")
    spec = importlib.util.spec_from_file_location("h200_spec", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "spec.json"
    bench.main(["--smoke", "--out", str(out), "--engines", "plain,mtp_k1,mtp_k3,ngram_k3"])
    result = json.loads(out.read_text())
    assert result["smoke"]
    for name in ("mtp_k1", "mtp_k3"):
        assert result[name]["async_scheduling"]
        assert result[name]["device_fixed_requests"] > 0  # async: inputs built from the step in flight
        for b in result["batches"]:
            row = result[name][f"b{b}"]
            assert row["acceptance_rate"] > 0.5 and row["tokens_per_request_step"] > 1.5
            assert row["greedy_equal_to_plain"] == 1.0
    assert result["plain"]["b1"]["tokens_per_request_step"] == 1.0
    assert result["ngram_k3"]["device_fixed_requests"] == 0  # a host proposer: corrected on the host
    assert all(result["ngram_k3"][f"b{b}"]["greedy_equal_to_plain"] == 1.0 for b in result["batches"])
