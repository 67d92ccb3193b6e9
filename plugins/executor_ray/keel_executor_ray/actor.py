"""RayWorker: the Ray actor that holds one rank's `Worker` (the "ray" executor creates one per rank)."""

from __future__ import annotations

import socket
from typing import Any


class RayWorker:
    """Built without arguments (cheap); the executor then calls `node_ip`, `start`, and `call` per RPC."""

    def __init__(self) -> None:
        self.worker = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(self, config: Any, rank: int, local_rank: int, local_world_size: int, init_method: str) -> None:
        """Build this rank's worker and join the rank grid (every rank must be in `start` together)."""
        from keel.worker.worker import Worker

        platform = config.platform()
        platform.configure_worker_process(local_rank, local_world_size)
        # Ray isolates each actor's accelerator (CUDA_VISIBLE_DEVICES holds just its own), so a device
        # platform's local index is 0 here; CPU ranks share the host.
        device_index = local_rank if platform.device_type == "cpu" else 0
        self.worker = Worker(config, config.plugin_set(), platform, rank=rank, local_rank=device_index,
                             distributed_init_method=init_method, local_world_size=local_world_size)
        self.worker.init_device()

    def call(self, method: str, args: tuple, kwargs: dict, reply: bool) -> Any:
        result = getattr(self.worker, method)(*args, **kwargs)
        return result if reply else None
