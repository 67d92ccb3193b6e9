"""`ProcessEngineCoreClient`: the engine core in its own process.

With the core on a thread of the API process, the server's Python work (HTTP, JSON, tokenization,
detokenization) and the core's Python work (scheduling, batch building) share one GIL. In its own
process the core steps undisturbed. Only plain data crosses the pipe -- `EngineCoreRequest`s and
request ids in, `EngineCoreOutputs` out -- so `AsyncLLM` and everything above it is unchanged.

The child is started with the `spawn` method (no inherited threads, CUDA state or locks), builds its
`EngineCore` from the picklable `EngineConfig` -- loading exactly the parent's plugins -- and runs the
same `run_core_loop` as the threaded client. A startup failure is raised in the parent with the
child's message; a child that dies later is reported as `EngineDeadError` to every pending request.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any

from keel.engine.engine_client import (
    _SHUTDOWN,
    CoreClientBase,
    EngineCoreOutputs,
    EngineDeadError,
    run_core_loop,
)

_READY = "ready"


def _core_main(config: Any, inbox: Any, outbox: Any) -> None:
    """Entry point of the engine-core process."""
    try:
        from keel.engine.core import EngineCore

        core = EngineCore(config)
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent, which raises it
        outbox.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    outbox.send((_READY, core.max_model_len))

    def receive(block: bool) -> tuple[str, Any] | None:
        if not block and not inbox.poll():
            return None
        try:
            return inbox.recv()
        except EOFError:  # the parent went away
            return (_SHUTDOWN, None)

    try:
        run_core_loop(core, receive, outbox.send)
    finally:
        core.shutdown()


class ProcessEngineCoreClient(CoreClientBase):
    """Starts the engine core in a child process; called by `AsyncLLM` when
    `parallel.engine_core_process` is set. Blocks in the constructor until the core is ready."""

    def __init__(self, config: Any, startup_timeout_s: float = 900.0) -> None:
        super().__init__()
        ctx = mp.get_context("spawn")
        core_inbox, self._to_core = ctx.Pipe(duplex=False)
        self._from_core, core_outbox = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_core_main, args=(config, core_inbox, core_outbox),
                                 name="keel-engine-core", daemon=True)
        self._proc.start()
        core_inbox.close()
        core_outbox.close()
        if not self._from_core.poll(startup_timeout_s):
            self._proc.kill()
            raise EngineDeadError(f"the engine core process did not start within {startup_timeout_s:.0f} s")
        try:
            kind, payload = self._from_core.recv()
        except EOFError:
            raise EngineDeadError(
                f"the engine core process exited during startup (exit code {self._proc.exitcode})"
            ) from None
        if kind != _READY:
            self._proc.join(timeout=5)
            raise EngineDeadError(f"the engine core process failed to start: {payload}")
        self.max_model_len: int = payload
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="keel-engine-core-reader", daemon=True)
        self._reader.start()

    def _transmit(self, msg: tuple[str, Any]) -> None:
        with self._send_lock:
            try:
                self._to_core.send(msg)
            except (BrokenPipeError, OSError) as exc:
                raise EngineDeadError(f"the engine core process is gone ({exc})") from None

    def _read(self) -> None:
        while True:
            try:
                msg = self._from_core.recv()
            except (EOFError, OSError):
                if not self._closed:
                    code = self._proc.exitcode
                    self._post(EngineCoreOutputs(error=f"the engine core process exited (exit code {code})"))
                return
            self._post(msg)
            if msg.error is not None:
                return

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with self._send_lock:
                self._to_core.send((_SHUTDOWN, None))
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
        self._to_core.close()
