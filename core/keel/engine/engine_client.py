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


def _snapshot(stats: SchedulerStats) -> SchedulerStats:
    # The scheduler keeps mutating its stats object; the other side must get a frozen copy.
    return dataclasses.replace(stats, num_finished_total=dict(stats.num_finished_total))


class ThreadedEngineCoreClient:
    """Runs an `EngineCore` busy loop in a daemon thread of this process.

    The thread is the only one that touches the core: it drains the input queue (adds, aborts) before
    every step, so an abort frees its blocks before the next forward pass, and sleeps on the queue when
    no request is unfinished. After each step or batch of messages it posts an `EngineCoreOutputs`.
    """

    def __init__(self, core: Any) -> None:
        self.core = core
        self._input: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._output: queue.Queue[EngineCoreOutputs] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="keel-engine-core", daemon=True)
        self._thread.start()

    # -- front-end side (event loop) -------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest, max_tokens: int) -> None:
        self._send((_ADD, (request, max_tokens)))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send((_ABORT, list(request_ids)))

    def _send(self, msg: tuple[str, Any]) -> None:
        if self._closed:
            raise EngineDeadError("the engine core client is shut down")
        self._input.put(msg)

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

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._input.put((_SHUTDOWN, None))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    # -- core side (engine thread) ---------------------------------------------------------------------

    def _post(self, msg: EngineCoreOutputs) -> None:
        self._output.put(msg)
        loop, ready = self._loop, self._ready
        if loop is not None and ready is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the loop closed between the check and the call
                pass

    def _handle(self, msg: tuple[str, Any]) -> bool:
        kind, payload = msg
        if kind == _ADD:
            request, max_tokens = payload
            self.core.add_request(request, max_tokens)
        elif kind == _ABORT:
            self.core.abort_requests(payload)
        elif kind == _SHUTDOWN:
            return False
        return True

    def _run(self) -> None:
        try:
            while True:
                # Idle: sleep on the queue instead of spinning.
                if not self.core.has_unfinished_requests() and not self._handle(self._input.get()):
                    return
                while True:
                    try:
                        msg = self._input.get_nowait()
                    except queue.Empty:
                        break
                    if not self._handle(msg):
                        return
                outputs = self.core.step() if self.core.has_unfinished_requests() else []
                self._post(EngineCoreOutputs(outputs, _snapshot(self.core.get_stats())))
        except Exception as exc:
            logger.exception("engine core loop died")
            self._post(EngineCoreOutputs(error=f"{type(exc).__name__}: {exc}"))
