"""The "mp" executor: one worker process per rank on this host, started and supervised by the engine core.

Workers are plain subprocesses (`python -m keel.distributed.worker_proc`), not multiprocessing
children: an engine core that itself runs in a daemonic process (the server's `engine_core_process`)
may start them, and the user's main module is never re-imported in them (spawn and forkserver would
re-run an unguarded script). Each connects back over an authenticated loopback socket; torch.distributed meets at a
second loopback port. While waiting for replies the executor watches every process: a rank that exits
fails the call at once with `WorkerDiedError` naming the rank and its exit status, and the remaining
ranks (possibly blocked in a collective with the dead one) are killed -- never a hang.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Listener, wait
from typing import Any

from keel.distributed.executor import Executor, WorkerDiedError, WorkerError
from keel.distributed.worker_proc import STOP, WorkerInit

logger = logging.getLogger("keel.distributed")

STARTUP_TIMEOUT_S = 900.0
_POLL_S = 0.2
# A worker's error can arrive before the death of the peer that caused it is visible.
_DEATH_GRACE_S = 1.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is unresponsive"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _start_worker(host: str, port: int, rank: int, authkey_hex: str) -> subprocess.Popen:
    env = {**os.environ, "KEEL_WORKER_AUTHKEY": authkey_hex}
    return subprocess.Popen([sys.executable, "-m", "keel.distributed.worker_proc", host, str(port), str(rank)],
                            env=env)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


class MultiprocExecutor(Executor):
    def __init__(self, config, plugins, platform) -> None:
        super().__init__(config, plugins, platform)
        self._dead: WorkerError | None = None
        self._closed = False
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = listener.address
        n = self.world_size
        self._procs = [_start_worker(host, port, rank, authkey.hex()) for rank in range(n)]
        self._finalizer = weakref.finalize(self, _kill, self._procs)
        atexit.register(self._finalizer)
        try:
            self._conns = self._accept(listener, n)
            init_method = f"tcp://127.0.0.1:{free_port()}"
            for rank, conn in enumerate(self._conns):
                conn.send(WorkerInit(config, rank, rank, n, init_method))
            self._gather(range(n), timeout=STARTUP_TIMEOUT_S)  # every rank built its worker and groups
        except BaseException:
            self.shutdown()
            raise
        finally:
            listener.close()
        logger.info("mp executor: %d worker processes (pids %s)", n, [p.pid for p in self._procs])

    def _accept(self, listener: Listener, n: int) -> list[Any]:
        """The ranks' connections in rank order, watching the processes while they start."""
        conns: dict[int, Any] = {}
        listener._listener._socket.settimeout(_POLL_S)  # accept() must not outwait a dead process
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(conns) < n:
            self._check_procs()
            if time.monotonic() > deadline:
                raise WorkerDiedError(-1, f"worker processes did not connect within {STARTUP_TIMEOUT_S:.0f} s")
            try:
                conn = listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            conns[conn.recv()] = conn
        return [conns[r] for r in range(n)]

    def _check_procs(self, grace_s: float = 0.0) -> None:
        """Fail with WorkerDiedError if a rank has exited (looking for up to `grace_s` seconds)."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, p in enumerate(self._procs):
                code = p.poll()
                if code is not None:
                    self._fail(WorkerDiedError(rank, f"worker rank {rank} (pid {p.pid}) {describe_exit(code)}"))
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _fail(self, error: WorkerError) -> None:
        self._dead = error
        self.shutdown()
        raise error

    def _gather(self, ranks, timeout: float | None = None) -> dict[int, Any]:
        """Each rank's reply to the last message; raises for a dead rank or a worker error."""
        pending = {self._conns[r]: r for r in ranks}
        results: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            ready = wait(list(pending), timeout=_POLL_S)
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    status, value, text = conn.recv()
                except (EOFError, OSError):
                    self._check_procs(grace_s=5.0)  # a closed connection is a process on its way out
                    self._fail(WorkerDiedError(rank, f"worker rank {rank} (pid {self._procs[rank].pid}) "
                                                     "closed its connection"))
                if status != "ok":
                    # A peer that died makes the survivors' collectives fail too: report the cause.
                    self._check_procs(grace_s=_DEATH_GRACE_S)
                    error = WorkerError(rank, f"worker rank {rank} failed:\n{text}")
                    if isinstance(value, BaseException):
                        value.add_note(f"(raised on worker rank {rank})")
                        self._dead = error
                        self.shutdown()
                        raise value
                    self._fail(error)
                results[rank] = value
            if not ready:
                self._check_procs()
                if deadline is not None and time.monotonic() > deadline:
                    self._fail(WorkerDiedError(min(pending.values()), f"workers {sorted(pending.values())} did "
                                               f"not answer within {timeout:.0f} s"))
        return results

    def _send_all(self, msg: Any) -> None:
        if self._dead is not None:
            raise self._dead
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(msg)
            except (BrokenPipeError, OSError):
                self._check_procs()
                self._fail(WorkerDiedError(rank, f"worker rank {rank} is gone (its connection closed)"))

    def collective_rpc(self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                       unique_reply_rank: int | None = None) -> list[Any]:
        self._launch(method, args, kwargs, None if unique_reply_rank is None else (unique_reply_rank,))
        results = self._gather(range(self.world_size))
        return [results[r] for r in range(self.world_size)]

    def _launch(self, method, args, kwargs, reply_ranks) -> None:
        """Send the call to every rank; `args` may be a function of the rank; `reply_ranks` None: all reply."""
        for rank, conn in enumerate(self._conns):
            if self._dead is not None:
                raise self._dead
            reply = reply_ranks is None or rank in reply_ranks
            rank_args = args(rank) if callable(args) else args
            try:
                conn.send((method, tuple(rank_args), dict(kwargs or {}), reply))
            except (BrokenPipeError, OSError):
                self._check_procs()
                self._fail(WorkerDiedError(rank, f"worker rank {rank} is gone (its connection closed)"))

    def execute_model(self, scheduler_output) -> Any:
        return self.execute_model_async(scheduler_output).get_output()

    def execute_model_async(self, scheduler_output) -> Any:
        """Sends the step and returns; the workers compute it while the engine core schedules the next."""
        self._launch("execute_model", lambda rank: (self.step_input(scheduler_output, rank),), None,
                     self.grid.output_ranks)
        return _PendingStep(self)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def worker_exit_codes(self) -> list[int | None]:
        return [p.poll() for p in self._procs]

    def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead
        self._check_procs()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in getattr(self, "_conns", []):
            try:
                conn.send(STOP)
            except (BrokenPipeError, OSError):
                pass
        # Workers hold nothing worth a slow goodbye: a short grace period, then the finalizer kills.
        deadline = time.monotonic() + (0 if self._dead is not None else 2)
        for p in self._procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._finalizer()  # kills whatever did not stop
        for conn in getattr(self, "_conns", []):
            conn.close()


class _PendingStep:
    def __init__(self, executor: MultiprocExecutor) -> None:
        self._executor = executor

    def get_output(self) -> Any:
        return self._executor.step_output(self._executor._gather(range(self._executor.world_size)))
