"""The engine-client seams: what the API layer calls, and how the front end reaches the engine core.

Two interfaces, as in vLLM v1:

- `EngineClient` (vLLM: `vllm.engine.protocol.EngineClient`): what HTTP endpoints and IO processors
  use -- `generate`, `abort`, `get_tokenizer`, health and stats. `keel.engine.async_llm.AsyncLLM`
  implements it; tokenization, detokenization and stop strings happen on its side, in the API process.
- `EngineCoreClient`: the boundary between that front end and the `EngineCore` loop. Only plain data
  crosses it (`EngineCoreRequest`, request ids, `EngineCoreOutputs`), so the core can move to its own
  process with msgpack over a socket by adding one more implementation; nothing above changes.

`ThreadedEngineCoreClient` is the in-process implementation: the engine core runs its busy loop in a
background thread, fed through a queue; outputs come back through a queue the asyncio side awaits.

A core that dies or hangs is the client's to notice: the first cause (the loop's own error, a dead
process, the step watchdog of `keel.engine.watchdog`) becomes the client's `EngineDeadError`, is
handed to the output loop as an error message, and every later message is dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from keel.engine.core_output import EngineCoreOutput, SchedulerStats
from keel.engine.output_processor import RequestOutputKind
from keel.engine.outputs import RequestOutput
from keel.engine.request import EngineCoreRequest
from keel.engine.sampling_params import SamplingParams
from keel.engine.watchdog import StepWatchdog, heartbeat_interval

logger = logging.getLogger("keel.engine")


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error; every pending and later request fails with this."""


@dataclass
class EngineCoreOutputs:
    """One message from the engine core: the outputs of one step (possibly none) and its counters.

    Plain data (no tensors, no tokenizer), so it can be msgpack-encoded when the core moves out of
    process. `error` is set (and everything else empty) when the core loop died.
    """

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = field(default_factory=time.monotonic)
    error: str | None = None


@runtime_checkable
class EngineCoreClient(Protocol):
    """The front end's handle on an engine core (in a thread today, maybe another process later).

    Called only by the front end (`AsyncLLM`) from its event loop. Calls never block on a step: they
    enqueue a message and return. The core applies messages in the order they were sent.
    """

    def add_request(self, request: EngineCoreRequest, max_tokens: int) -> None:
        """Queue an already validated request (`max_tokens` already capped to the context)."""
        ...

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish these engine requests and free their KV blocks before the next step; unknown ids
        are ignored."""
        ...

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next message from the core, in order; waits without blocking the event loop."""
        ...

    def check_health(self) -> None:
        """Raises EngineDeadError once the core has died, hung past the step timeout, or been shut
        down. Called by the front end (health probes, before queuing); cheap, never blocks."""
        ...

    def shutdown(self) -> None:
        """Stop the core loop and release it; idempotent."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    """What the API layer (endpoints, IO processors) uses; `AsyncLLM` implements it.

    Guarantees: `add_request` validates before queuing (a bad prompt raises ValueError /
    PromptTooLongError and nothing is queued); a request whose consumer goes away is aborted and its
    KV blocks freed; `generate` yields `RequestOutput`s of `output_kind`, the last one `finished`.
    """

    @property
    def max_model_len(self) -> int: ...

    @property
    def errored(self) -> bool: ...

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer (None with skip_tokenizer_init). Not thread-safe: use it through
        `run_in_tokenizer_thread` from async code."""
        ...

    async def run_in_tokenizer_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run tokenizer work off the event loop, on the one thread that owns the tokenizer."""
        ...

    def generate(
        self, prompt: Any, sampling_params: SamplingParams, request_id: str,
        *, output_kind: RequestOutputKind = RequestOutputKind.DELTA,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def check_health(self) -> None:
        """Raises EngineDeadError if the engine loop has died."""
        ...

    def get_metrics(self) -> dict[str, Any]: ...

    def shutdown(self) -> None: ...


# Messages into the core loop. Tuples of plain data: the same shapes a socket transport would carry.
_ADD, _ABORT, _SHUTDOWN = "add", "abort", "shutdown"
# Out of an idle core loop: "still alive", for the step watchdog.
_HEARTBEAT = "heartbeat"


def _snapshot(stats: SchedulerStats) -> SchedulerStats:
    # The scheduler keeps mutating its stats object; the other side must get a frozen copy.
    return dataclasses.replace(stats, num_finished_total=dict(stats.num_finished_total))


class CoreClientBase:
    """The front-end half both engine-core clients share: requests and aborts become messages handed
    to `_transmit` (a subclass's transport); outputs posted from another thread (the core loop, or a
    pipe reader) are awaited by the event loop without blocking it. `step_timeout_s` (0 or None: off)
    arms a `StepWatchdog` once a subclass calls `_start_watchdog`."""

    def __init__(self, step_timeout_s: float | None = None) -> None:
        self._output: queue.Queue[EngineCoreOutputs] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self._closed = False
        self._dead: EngineDeadError | None = None
        self._dead_lock = threading.Lock()
        self.step_timeout_s = step_timeout_s or None
        self._watchdog: StepWatchdog | None = None

    @property
    def heartbeat_s(self) -> float | None:
        """How often the core loop must speak while idle (None: it need not)."""
        return heartbeat_interval(self.step_timeout_s)

    def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineDeadError("the engine core client is shut down")

    def add_request(self, request: EngineCoreRequest, max_tokens: int) -> None:
        self._send((_ADD, (request, max_tokens)))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send((_ABORT, list(request_ids)))

    def _send(self, msg: tuple[str, Any]) -> None:
        if self._closed:
            raise EngineDeadError("the engine core client is shut down")
        self._transmit(msg)

    def _transmit(self, msg: tuple[str, Any]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    async def get_output_async(self) -> EngineCoreOutputs:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._ready = loop, asyncio.Event()
        assert self._ready is not None
        while True:
            try:
                return self._output.get_nowait()
            except queue.Empty:
                pass
            self._ready.clear()
            # Re-check after clearing: an output posted in between must not be missed.
            try:
                return self._output.get_nowait()
            except queue.Empty:
                await self._ready.wait()

    def _start_watchdog(self) -> None:
        if self.step_timeout_s is not None:
            self._watchdog = StepWatchdog(self.step_timeout_s, self._on_hung)

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()

    def _heard(self) -> None:
        if self._watchdog is not None:
            self._watchdog.heard()

    def _on_hung(self, message: str) -> None:
        """Called by the watchdog's thread; a subclass may also stop the hung core."""
        self._fail_core(message)

    def _fail_core(self, message: str) -> None:
        """Declare the core dead (from any thread); the first cause wins."""
        self._post(EngineCoreOutputs(error=message))

    def _post(self, msg: EngineCoreOutputs) -> None:
        """Called from the producing thread. After the core was declared dead, messages are stale."""
        self._heard()
        with self._dead_lock:
            if self._dead is not None:
                return
            if msg.error is not None:
                self._dead = EngineDeadError(msg.error)
                self._stop_watchdog()
        self._output.put(msg)
        loop, ready = self._loop, self._ready
        if loop is not None and ready is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the loop closed between the check and the call
                pass


def run_core_loop(core: Any, receive: Callable[[float | None], tuple[str, Any] | None],
                  post: Callable[[EngineCoreOutputs], None], heartbeat: Callable[[], None] | None = None,
                  heartbeat_s: float | None = None) -> None:
    """The engine core's busy loop, whatever carries its messages.

    `receive(timeout)` returns the next message, or None when none came within `timeout` seconds (0:
    do not wait, None: wait for one). Messages are drained before every step, so an abort frees its
    blocks before the next forward pass; with nothing unfinished the loop sleeps in `receive`, calling
    `heartbeat()` every `heartbeat_s` seconds meanwhile (for the step watchdog). After each step it
    posts one `EngineCoreOutputs`; if the core raises, it posts the error and returns.
    """

    def handle(msg: tuple[str, Any]) -> bool:
        kind, payload = msg
        if kind == _ADD:
            request, max_tokens = payload
            core.add_request(request, max_tokens)
        elif kind == _ABORT:
            core.abort_requests(payload)
        elif kind == _SHUTDOWN:
            return False
        return True

    try:
        while True:
            if not core.has_unfinished_requests():
                msg = receive(heartbeat_s)
                if msg is None:
                    # Workers can die between requests too: a dead rank fails the loop (and /health).
                    check = getattr(core, "check_health", None)
                    if check is not None:
                        check()
                    if heartbeat is not None:
                        heartbeat()
                    continue
                if not handle(msg):
                    return
            while (msg := receive(0)) is not None:
                if not handle(msg):
                    return
            outputs = core.step() if core.has_unfinished_requests() else []
            post(EngineCoreOutputs(outputs, _snapshot(core.get_stats())))
    except Exception as exc:
        logger.exception("engine core loop died")
        post(EngineCoreOutputs(error=f"the engine core loop died: {type(exc).__name__}: {exc}"))


class ThreadedEngineCoreClient(CoreClientBase):
    """Runs an `EngineCore` busy loop (`run_core_loop`) in a daemon thread of this process; the thread
    is the only one that touches the core. A thread cannot be killed: a step that never returns is
    reported by the watchdog and its thread abandoned."""

    def __init__(self, core: Any, step_timeout_s: float | None = None) -> None:
        super().__init__(step_timeout_s)
        self.core = core
        self._input: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="keel-engine-core", daemon=True)
        self._thread.start()
        self._start_watchdog()

    # -- front-end side (event loop) -------------------------------------------------------------------

    def _transmit(self, msg: tuple[str, Any]) -> None:
        self._input.put(msg)

    def check_health(self) -> None:
        if self._dead is None and not self._closed and not self._thread.is_alive():
            self._fail_core("the engine core thread exited")
        super().check_health()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_watchdog()
        self._input.put((_SHUTDOWN, None))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=1 if self._dead is not None else 10)  # a hung step never returns

    # -- core side (engine thread) ---------------------------------------------------------------------

    def _receive(self, timeout: float | None) -> tuple[str, Any] | None:
        try:
            return self._input.get_nowait() if timeout == 0 else self._input.get(timeout=timeout)
        except queue.Empty:
            return None

    def _run(self) -> None:
        run_core_loop(self.core, self._receive, self._post, self._heard, self.heartbeat_s)
