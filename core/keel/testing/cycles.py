"""What a piece of work leaves in reference cycles: the objects only the cyclic garbage collector frees.

Used by tests/test_step_gc_cycles.py and benchmarks/gc_per_step.py around engine steps. Garbage that
reference counting frees is never seen here; an object in a cycle (and whatever it alone holds) is.
"""

from __future__ import annotations

import gc
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
