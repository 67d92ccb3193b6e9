"""Nsight Compute's raw CSV (`ncu --csv --page raw`) reduced to what bounds each kernel: its duration, DRAM and SM
throughput, warp cycles per issued instruction, occupancy, and the stall reasons that take most of those cycles
(`smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio`: warps stalled for that reason per issued
instruction; the reasons sum to about the cycles per issue).

    python benchmarks/ncu_stalls.py ncu.csv [--top 6] [--out rows.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
FIELDS = {  # our name -> ncu's raw metric
    "duration_us": "gpu__time_duration.sum",
    "dram_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "warp_cycles_per_issue": "smsp__average_warp_latency_per_inst_issued.ratio",
    "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "registers": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
}


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def rows(lines: list[str], top: int = 6) -> list[dict]:
    """One dict per profiled kernel launch: FIELDS found in the CSV, and `stalls` (reason -> warps per issue,
    the `top` largest, descending). ncu prints its own log lines before the CSV: the header is the first line
    that starts with a quoted "ID"."""
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    table = list(csv.reader(lines[start:]))
    header, units = table[0], table[1]
    data = table[2:] if any(u and not _number(u) for u in units) else table[1:]  # the units row, when present
    scale = {FIELDS["duration_us"]: _scale_to_us(header, units, FIELDS["duration_us"])}  # the others are unitless
    out = []
    for values in data:
        rec = dict(zip(header, values))
        row = {"kernel": rec.get("Kernel Name", "?")}
        for name, metric in FIELDS.items():
            if metric in rec and (v := _number(rec[metric])) is not None:
                row[name] = round(v * scale.get(metric, 1.0), 3)
        stalls = {m.group(1): v for key, text in rec.items()
                  if (m := STALL.match(key)) and (v := _number(text)) is not None}
        row["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:top])
        out.append(row)
    return out


def _scale_to_us(header: list[str], units: list[str], metric: str) -> float:
    unit = units[header.index(metric)] if metric in header and len(units) == len(header) else "ns"
    return {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(unit, 1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--out")
    args = ap.parse_args()
    found = rows(Path(args.csv).read_text(errors="replace").splitlines(), args.top)
    for row in found:
        head = " ".join(f"{k}={row[k]}" for k in FIELDS if k in row)
        stalls = " ".join(f"{k}={v:.2f}" for k, v in row["stalls"].items())
        print(f"{row['kernel'][:40]} {head} | {stalls}")
    if args.out:
        Path(args.out).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
