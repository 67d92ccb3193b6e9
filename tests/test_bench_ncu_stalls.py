"""benchmarks/ncu_stalls.py reads Nsight Compute's raw CSV (log lines first, a units row) into per-kernel rows with
the largest stall reasons; ncu_small_m.py's fold plans parse as the part's NCU_FOLD_PLANS spells them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ncu_small_m  # noqa: E402
import ncu_stalls  # noqa: E402

CSV = '''==PROF== Connected to process 1
==PROF== Profiling "_int4_gemv_fold_kernel": 0%....50%....100% - 40 passes
"ID","Kernel Name","gpu__time_duration.sum","dram__throughput.avg.pct_of_peak_sustained_elapsed",\
"launch__grid_size","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"
"","","nsecond","%","","inst","inst","inst"
"0","_int4_gemv_fold_kernel","12,100","23.1","384","3.5","0.25","0.9"
"1","_int4_gemv_fold_kernel","27260","24.46","256","2.0","1.5",""
'''


def test_rows_take_fields_units_and_top_stalls() -> None:
    rows = ncu_stalls.rows(CSV.splitlines(), top=2)
    assert [r["kernel"] for r in rows] == ["_int4_gemv_fold_kernel"] * 2
    assert rows[0]["duration_us"] == pytest.approx(12.1) and rows[1]["duration_us"] == pytest.approx(27.26)
    assert rows[0]["dram_pct"] == 23.1 and rows[0]["grid"] == 384
    assert list(rows[0]["stalls"]) == ["long_scoreboard", "wait"]  # descending, top 2
    assert rows[1]["stalls"] == {"long_scoreboard": 2.0, "barrier": 1.5}  # an empty cell is no number


def test_fold_plans_parse() -> None:
    plan = ncu_small_m.fold_plan("1x16x1024x2s2w8")
    assert (plan.kernel, plan.block_m, plan.block_n, plan.block_k, plan.split_k) == ("gemv_fold", 1, 16, 1024, 2)
    assert (plan.num_stages, plan.num_warps) == (2, 8)
    plain = ncu_small_m.fold_plan("1x8x512")
    assert (plain.split_k, plain.num_stages, plain.num_warps) == (1, None, 4)
    with pytest.raises(SystemExit, match="BMxBNxBK"):
        ncu_small_m.fold_plan("1x8")
