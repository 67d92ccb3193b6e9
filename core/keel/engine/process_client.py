"""`ProcessEngineCoreClient`: the engine core in its own process.

With the core on a thread of the API process, the server's Python work (HTTP, JSON, tokenization,
detokenization) and the core's Python work (scheduling, batch building) share one GIL. In its own
process the core steps undisturbed. Only plain data crosses the pipe -- `EngineCoreRequest`s and
request ids in, `EngineCoreOutputs` out -- so `AsyncLLM` and everything above it is unchanged.

The child is started with the `spawn` method (no inherited threads, CUDA state or locks), builds its
`EngineCore` from the picklable `EngineConfig` -- loading exactly the parent's plugins -- and runs the
same `run_core_loop` as the threaded client. A startup failure is raised in the parent with the
child's message. A child that dies later -- idle or busy -- is seen at once (its pipe closes, its
process sentinel fires) and reported as `EngineDeadError` naming its exit code or signal; a child that
stops answering (SIGSTOP, a wedged step) is killed by the step watchdog.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
from multiprocessing.connection import wait
from typing import Any

from keel.engine.engine_client import (
    _HEARTBEAT,
    _SHUTDOWN,
    CoreClientBase,
    EngineDeadError,
    run_core_loop,
)
from keel.engine.watchdog import heartbeat_interval

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

    def receive(timeout: float | None) -> tuple[str, Any] | None:
        try:
            if not inbox.poll(timeout):
                return None
            return inbox.recv()
        except EOFError:  # the parent went away
            return (_SHUTDOWN, None)

    timeout = config.parallel.engine_iteration_timeout_s
    try:
        run_core_loop(core, receive, outbox.send, lambda: outbox.send(_HEARTBEAT), heartbeat_interval(timeout))
    finally:
        core.shutdown()


class ProcessEngineCoreClient(CoreClientBase):
    """Starts the engine core in a child process; called by `AsyncLLM` when
    `parallel.engine_core_process` is set. Blocks in the constructor until the core is ready."""

    def __init__(self, config: Any, startup_timeout_s: float = 900.0) -> None:
        super().__init__(config.parallel.engine_iteration_timeout_s)
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
            raise EngineDeadError(f"the engine core process exited during startup ({self._exit_status()})") from None
        if kind != _READY:
            self._proc.join(timeout=5)
            raise EngineDeadError(f"the engine core process failed to start: {payload}")
        self.max_model_len: int = payload
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="keel-engine-core-reader", daemon=True)
        self._reader.start()
        self._start_watchdog()

    def _transmit(self, msg: tuple[str, Any]) -> None:
        with self._send_lock:
            try:
                self._to_core.send(msg)
            except (BrokenPipeError, OSError) as exc:
                raise EngineDeadError(f"the engine core process is gone ({exc})") from None

    def _read(self) -> None:
        """The reader thread: posts the core's outputs; notices the process ending even if a child of
        its own still holds the pipe open (the process sentinel)."""
        while True:
            ready = wait([self._from_core, self._proc.sentinel])
            try:
                msg = self._from_core.recv() if self._from_core in ready or self._from_core.poll() else None
            except (EOFError, OSError):
                msg = None
            if msg is None:
                if not self._closed:
                    self._fail_core(f"the engine core process (pid {self._proc.pid}) died ({self._exit_status()})")
                return
            if msg == _HEARTBEAT:
                self._heard()
                continue
            self._post(msg)
            if msg.error is not None:
                return

    def _exit_status(self) -> str:
        self._proc.join(timeout=5)  # the pipe closes a moment before the process is reaped
        code = self._proc.exitcode
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exit code {code}"

    def _on_hung(self, message: str) -> None:
        self._fail_core(message + "; the engine core process was killed")
        self._proc.kill()  # also ends a stopped (SIGSTOP) process; its reader then sees it gone

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_watchdog()
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
