"""The "uni" executor: one worker in the engine core's own process (world size 1)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keel.distributed.executor import Executor


class UniProcExecutor(Executor):
    in_process = True

    def __init__(self, config, plugins, platform) -> None:
        super().__init__(config, plugins, platform)
        from keel.worker.worker import Worker

        if self.world_size != 1:
            raise ValueError(f"the 'uni' executor runs one worker, not {self.world_size}")
        self.driver_worker = Worker(config, plugins, platform)
        self.driver_worker.init_device()

    def collective_rpc(self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                       unique_reply_rank: int | None = None) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args, **(kwargs or {}))]

    def execute_model(self, scheduler_output):
        return self.driver_worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output):
        return self.driver_worker.execute_model_async(scheduler_output)
