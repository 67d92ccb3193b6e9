"""benchmarks/gc_per_step.py --smoke runs on the CPU (tiny model, batch 4) and reports what the H200 run reports:
no objects left in reference cycles by the engine's steps, with and without bitmask_timeline's wrappers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("keel_structured_output_xgrammar")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gc_per_step.py"


def test_smoke_run_finds_no_cycles_and_reports_the_collections(tmp_path):
    out = tmp_path / "gc.json"
    subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], check=True, timeout=300,
                   capture_output=True, text=True)
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"plain", "constrained", "plain_timeline", "constrained_timeline"}
    for name, run in result["runs"].items():
        assert run["cyclic"]["objects"] == 0, (name, run["cyclic"])
        assert run["running_at_start"] == result["batch"], name  # a grammar may end within the steps
        for g in ("gen0", "gen1", "gen2"):
            assert run["served"][g]["count"] >= 0 and run["served"][g]["collected_per_step"] == 0, (name, g)
