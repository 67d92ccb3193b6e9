"""The mid-size GEMM sweeps' shared bookkeeping (benchmarks/h200_quant.py, used by h200_int4_mma.py and
h200_fp8_mid_m.py) on the CPU: a label timed on every layer of an M has a total, one missing on a layer (past the
budget, or failed) has none -- a partial sum would look fast -- and a failing candidate is recorded, not raised."""

from __future__ import annotations

from pathlib import Path

import torch

from keel.testing.scripts import load_script

QUANT = Path(__file__).resolve().parents[1] / "benchmarks" / "h200_quant.py"


def test_totals_keep_only_labels_timed_on_every_layer():
    bench = load_script(QUANT)
    rows = [{"m": 64, "us": {"a": 1.0, "b": 2.0}}, {"m": 64, "us": {"a": 3.0}},
            {"m": 128, "us": {"a": 5.0, "b": 1.0}}, {"m": 128, "us": {"a": 5.0, "b": 1.5}}]
    assert bench.totals_per_m(rows, 2) == {64: {"a": 4.0}, 128: {"a": 10.0, "b": 2.5}}


def test_time_paths_records_a_failing_candidate_and_skips_candidates_past_the_budget(monkeypatch):
    bench = load_script(QUANT)
    monkeypatch.setattr(bench, "graph_us", lambda fn, calls: 7.0)  # no GPU: the timing itself is not under test
    ref = torch.ones(2, 2)

    def boom(i):
        raise RuntimeError("out of shared memory")

    fns = {"today": (1, lambda i: ref), "mma ok": (1, lambda i: ref * 1.5), "mma bad": (1, boom)}
    row = bench.time_paths({"us": {}, "max_rel_diff": {}}, fns, ref, "mma", lambda: False)
    assert row["us"] == {"today": 7.0, "mma ok": 7.0} and row["max_rel_diff"] == {"mma ok": 0.5}
    assert row["errors"]["mma bad"].startswith("RuntimeError: out of shared memory")
    late = bench.time_paths({"us": {}, "max_rel_diff": {}}, fns, ref, "mma", lambda: True)
    assert late["us"] == {"today": 7.0} and "errors" not in late
