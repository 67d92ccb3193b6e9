"""benchmarks/h200_run.sh dispatches its parts with one bash `case`, where the first matching label wins: a part
name used twice runs the first body only, silently (mla-attn-ab was once added as a second mla-attn). Each
part is one label, and each part the header documents is one the case serves."""

from __future__ import annotations

import collections
import fnmatch
import re
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "h200_run.sh"


def _labels_and_documented() -> tuple[list[str], list[str]]:
    lines = SCRIPT.read_text().splitlines()
    labels = [p for line in lines if (m := re.match(r"^    ([\w|*.-]+)\)", line)) for p in m.group(1).split("|")]
    documented = [m.group(1) for line in lines if (m := re.match(r"^#   ([\w-]+)\s", line))]
    return labels, documented


def test_every_part_label_is_used_once() -> None:
    labels, _ = _labels_and_documented()
    assert len(labels) > 30  # the parser found the dispatch
    twice = [name for name, n in collections.Counter(labels).items() if n > 1]
    assert not twice, f"h200_run.sh: part labels used more than once (the later bodies never run): {twice}"


def test_every_documented_part_is_dispatched() -> None:
    labels, documented = _labels_and_documented()
    assert documented
    missing = [d for d in documented if not any(fnmatch.fnmatch(d, p) for p in labels)]
    assert not missing, f"h200_run.sh documents parts its case does not serve: {missing}"
