"""benchmarks/throughput_budget.py's census drives keel's real scheduler: the step count it reports (and the README
and architecture.md quote) must stay what the scheduler does, and the script must keep running on its API."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import throughput_budget as tb  # noqa: E402


def test_census_is_the_near_ideal_schedule_the_docs_quote():
    steps = tb.census()
    decoding = [b for b, p in steps if not p]
    prefilling = [(b, p) for b, p in steps if p]
    assert len(steps) == 515 and len(decoding) == 496 and len(prefilling) == 19
    # every prompt token is scheduled once (a 1-token chunk counts as a decode step's token)
    assert tb.NUM_PROMPTS * tb.PROMPT - 1 <= sum(p for _, p in prefilling) <= tb.NUM_PROMPTS * tb.PROMPT
    # every sampled token: the first after the prompt, then 127 decodes each
    assert sum(b for b, _ in steps) >= tb.NUM_PROMPTS * (tb.OUTPUT - 1)
    assert max(b for b, _ in steps) <= tb.SEQS


def test_price_is_linear_in_batch_and_prefill_tokens():
    p = tb.price([(256, 0), (1, 0), (0, 8192), (128, 4096)], b1_ms=2.0, b256_ms=12.0, prefill_ms=100.0)
    mid = 2.0 + 10.0 * 127 / 255
    assert abs(p["decode_steps_s"] - 0.014) < 1e-12
    assert abs(p["prefill_steps_s"] - (100.0 + mid + 50.0) / 1e3) < 1e-12
