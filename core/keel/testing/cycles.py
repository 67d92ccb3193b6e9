"""What a piece of work leaves in reference cycles (the objects only the cyclic garbage collector frees),
and the collector's runs while it works.

Used by tests/test_step_gc_cycles.py and benchmarks/gc_per_step.py / bitmask_timeline.py around engine
steps. Garbage that reference counting frees is never seen by `cyclic_garbage`; an object in a cycle (and
whatever it alone holds) is.
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from collections.abc import Callable


def cyclic_garbage(work: Callable[[], None]) -> tuple[int, Counter]:
    """(objects found in cycles, their type names) after `work()` runs with the collector off.

    Collects first, so only what `work` leaves counts; the collector's state (enabled, debug flags,
    gc.garbage) is restored, and the objects found are freed, whether or not `work` raises."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collection finds stays in gc.garbage, to be named
    try:
        work()
        found = gc.collect()
        kinds = Counter(type(o).__qualname__ for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()
    return found, kinds


class CollectionLog:
    """Each run of the cyclic collector while attached (gc.callbacks), whichever thread it ran on."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, float, float, int]] = []  # (generation, begin ms, end ms, objects freed)
        self._begin = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._begin = time.perf_counter() * 1e3
        else:
            self.runs.append((info["generation"], self._begin, time.perf_counter() * 1e3, info["collected"]))

    def attach(self) -> CollectionLog:
        gc.callbacks.append(self._on_gc)
        return self

    def detach(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def by_generation(self) -> dict[str, dict]:
        """gen0..gen2 -> the count of runs, their total and longest pause (ms), the objects they freed."""
        out = {}
        for g in range(3):
            pauses = [e - b for gen, b, e, _ in self.runs if gen == g]
            out[f"gen{g}"] = {"count": len(pauses), "total_ms": round(sum(pauses), 3),
                              "max_ms": round(max(pauses, default=0.0), 3),
                              "collected": sum(n for gen, _, _, n in self.runs if gen == g)}
        return out
