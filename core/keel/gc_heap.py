"""Keep Python's cyclic garbage collector off the startup heap.

After startup a process holds a few hundred thousand long-lived objects (torch, transformers, triton,
the model's modules and parameters); every full collection walks them all: ~250 ms on a 2-core CPU,
and on the H200 a batch-256 DeepSeek-V2-Lite decode step that usually takes 13 ms took ~246 ms twice
per benchmark round (`benchmarks/h200_vs_vllm.py --diagnose`). Freezing moves them into the permanent
generation, so later collections walk only what was made since (requests, outputs).

Called by the worker once its KV cache and graphs exist, by the engine core when it is ready, and by
the async front end when its engine is up. `sleep` thaws first: level 2 drops the model, and a frozen
cycle is never collected.
"""

from __future__ import annotations

import atexit
import gc


def freeze_startup_heap() -> None:
    """Collect once, then freeze everything alive: called at the end of startup (and of `wake_up`)."""
    gc.collect()
    gc.freeze()
    # Thawed at exit, so the interpreter's last collections free them as before (frozen, triton's
    # nanobind objects were reported as leaked on every exit).
    atexit.unregister(thaw_heap)
    atexit.register(thaw_heap)


def thaw_heap() -> None:
    """Let the collector see the frozen objects again (before freeing the model or the KV cache)."""
    gc.unfreeze()
