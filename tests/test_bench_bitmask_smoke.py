"""benchmarks/h200_bitmask.py --smoke runs on the CPU (tiny model, batch 4) and reports every figure the
GPU run reports, so the lead's one-call H200 measurement does not fail on a script error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("keel_structured_output_xgrammar")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "h200_bitmask.py"


def test_smoke_run_reports_the_engine_and_device_figures(tmp_path):
    out = tmp_path / "bitmask.json"
    subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--fill-threads-also", "2", "--out", str(out)], check=True, timeout=600,
                   capture_output=True, text=True)
    result = json.loads(out.read_text())
    engine = result["engine"]
    for run in ("plain", "constrained", "constrained_default_switch_interval", "every_other_step", "plain_after",
                "constrained_after", "constrained_2_threads"):
        assert engine[run]["ms_per_step"] > 0 and engine[run]["running_at_start"] == result["batch"]
    # Constrained requests advance every step; the former path skips the step after each token.
    assert engine["constrained"]["tokens_per_step"] == result["batch"]
    assert engine["every_other_step"]["tokens_per_step"] < result["batch"]
    assert engine["constrained"]["host_fill_ms"] is not None and engine["plain"]["host_fill_ms"] is None
    # The breakdown the GPU run reports: main thread, fill thread, runner.
    parts = engine["constrained"]["breakdown"]
    for key in ("schedule_ms", "launch_ms", "tokens_wait_ms", "apply_ms", "apply_grammar_ms", "output_ms",
                "advance_ms", "landed_to_filled_ms", "start_after_launch_ms", "wake_ms", "fill_job_ms", "batch_fill_ms",
                "runner_wait_ms", "launch_update_states_ms", "launch_prepare_inputs_ms", "launch_stage_ms",
                "launch_forward_ms", "launch_logits_ms", "launch_sampling_metadata_ms", "launch_sampler_ms"):
        assert parts[key] >= 0 or key == "start_after_launch_ms", key
    assert isinstance(parts["trace"], list) and result["host_cpus"]["cpus"] >= 1
    for key in ("overhead_fraction", "device_ms_torch_reference", "host_fill_ms", "decode_step_ms"):
        assert key in result or key in engine


def test_gil_benchmark_smoke_run_reports_its_figures(tmp_path):
    """benchmarks/bitmask_gil.py (the fill thread's GIL cost to the engine loop, CPU only) runs and reports
    what the H200 call reads."""
    out = tmp_path / "gil.json"
    subprocess.run([sys.executable, str(SCRIPT.parent / "bitmask_gil.py"), "--smoke", "--out", str(out)], check=True,
                   timeout=300, capture_output=True, text=True)
    result = json.loads(out.read_text())
    for key in ("gil_takes", "python_cpu_ms", "fill_thread_cpu_ms", "stolen_ms", "stolen_outside_fill_ms",
                "chain_ms", "chain_idle_ms"):
        assert key in result, key
    assert 0 <= result["python_cpu_ms"] <= result["fill_thread_cpu_ms"] and result["batch"] == 4
