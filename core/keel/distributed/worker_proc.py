"""The worker process of the "mp" executor: `python -m keel.distributed.worker_proc HOST PORT RANK`
(authkey in $KEEL_WORKER_AUTHKEY).

It connects back to the executor, receives its `WorkerInit`, builds
its `Worker` (loading exactly the engine's plugins: the config travels), then serves calls until told to
stop, until the executor's end of the connection closes, or until its parent process is gone -- so an
engine that dies never leaves ranks behind.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

STOP = "__stop__"


@dataclass(frozen=True)
class WorkerInit:
    """What one rank needs to start: the engine's config, its place in the world, the rendezvous."""

    config: Any
    rank: int
    local_rank: int
    local_world_size: int
    distributed_init_method: str


def _exit_with_parent(parent_pid: int) -> None:
    # The executor normally stops its workers; this covers an engine killed without running shutdown.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _error_payload(exc: BaseException) -> tuple[str, Any, str]:
    import pickle

    text = "".join(traceback.format_exception(exc))
    try:
        pickle.dumps(exc)
        return ("error", exc, text)
    except Exception:  # noqa: BLE001 -- an unpicklable exception still reaches the engine as text
        return ("error", None, text)


def serve(conn: Any, init: WorkerInit) -> None:
    """Build the worker and answer (method, args, kwargs, reply) messages until stopped."""
    from keel.worker.worker import Worker

    config = init.config
    plugins = config.plugin_set()
    platform = config.platform()
    platform.configure_worker_process(init.local_rank, init.local_world_size)
    worker = Worker(config, plugins, platform, rank=init.rank, local_rank=init.local_rank,
                    distributed_init_method=init.distributed_init_method, local_world_size=init.local_world_size)
    worker.init_device()
    conn.send(("ok", None, None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg == STOP:
            return
        method, args, kwargs, reply = msg
        try:
            result = getattr(worker, method)(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 -- every failure is reported to the engine
            conn.send(_error_payload(exc))
            continue
        conn.send(("ok", result if reply else None, None))


def main(argv: list[str]) -> int:
    return run_worker(argv[0], int(argv[1]), int(argv[2]), os.environ["KEEL_WORKER_AUTHKEY"])


def run_worker(host: str, port: int, rank: int, authkey_hex: str) -> int:
    from multiprocessing.connection import Client

    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    logging.basicConfig(level=os.environ.get("KEEL_LOG_LEVEL", "WARNING"),
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    conn = Client((host, port), authkey=bytes.fromhex(authkey_hex))
    conn.send(rank)
    try:
        init = conn.recv()
        serve(conn, init)
    except BaseException as exc:  # noqa: BLE001 -- a startup failure goes to the engine, then we exit
        try:
            conn.send(_error_payload(exc))
        except OSError:
            pass
        return 1
    finally:
        from keel.distributed.parallel_state import destroy_distributed_environment

        try:
            destroy_distributed_environment()
        except Exception:  # noqa: BLE001 -- leaving anyway
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
