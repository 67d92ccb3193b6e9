"""`StepWatchdog`: turns an engine core that stops talking into an error.

The core loop speaks after every step and, while idle, at least every `heartbeat_interval(timeout)`
seconds (`run_core_loop`'s heartbeat). The front end's engine-core client calls `heard()` for every
message; a silence longer than the step timeout (`parallel.engine_iteration_timeout_s`, vLLM's
`VLLM_ENGINE_ITERATION_TIMEOUT_S`) means a step that never returns, or a core process that is stopped
(SIGSTOP) or wedged. The watchdog then calls `on_timeout(message)` once, from its own thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def heartbeat_interval(timeout_s: float | None) -> float | None:
    """How often an idle core says it is alive: well inside the timeout; None (never) without one."""
    return min(timeout_s / 4, 5.0) if timeout_s else None


class StepWatchdog:
    """Started by an engine-core client once its core is ready; stopped by its `shutdown`."""

    def __init__(self, timeout_s: float, on_timeout: Callable[[str], None]) -> None:
        self.timeout_s = timeout_s
        self._on_timeout = on_timeout
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="keel-engine-watchdog", daemon=True)
        self._thread.start()

    def heard(self) -> None:
        """The core said something (an output or a heartbeat); called from any thread."""
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        poll = min(self.timeout_s / 8, 1.0)
        while not self._stopped.wait(poll):
            silent = time.monotonic() - self._last
            if silent > self.timeout_s:
                self._on_timeout(
                    f"the engine core is hung: nothing from it for {silent:.1f} s, past the step timeout "
                    f"(engine_iteration_timeout_s={self.timeout_s:g})"
                )
                return
