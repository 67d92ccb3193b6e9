"""Executor: how the engine core drives its N workers (the `executor` registry kind).

Who calls: only the `EngineCore`, from its one thread, one call at a time, in this order:
`collective_rpc("load_model")`, `("warm_up")`, `("determine_num_blocks", ...)` (the core keeps the
minimum over ranks, so every rank's cache fits), `("initialize_kv_cache", ...)`, `("kv_cache_spec")`,
then `execute_model` / `execute_model_async` every step, and `shutdown` once at the end.

Guarantees an executor gives: every worker receives every call in the same order (they run the same
step in lockstep: collectives pair up); results come back in rank order; a worker that raises, dies or
disappears makes the call raise (`WorkerError` / `WorkerDiedError`, naming the rank) instead of hanging,
and the executor is dead afterwards (every later call raises the same error). Built-ins: "uni" (one
worker in the engine core's process) and "mp" (one process per rank on this host); plugins add others
("ray").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from keel.distributed.grid import RankGrid

if TYPE_CHECKING:
    from keel.config import EngineConfig
    from keel.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from keel.platform import Platform


class WorkerError(RuntimeError):
    """A worker raised while serving a call; the message names its rank and the worker's error."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class WorkerDiedError(WorkerError):
    """A worker process (or actor) ended while the engine still needed it."""


class Executor:
    """Base class of every executor. A subclass starts its workers in `__init__` (each built with
    `Worker(config, plugins, platform, rank=..., local_rank=..., distributed_init_method=...)` and its
    `init_device()` done) and implements `collective_rpc` and `shutdown`."""

    # Whether every rank runs on this host's devices (then the world size is checked against
    # `Platform.device_count()` at startup); executors spanning hosts check their cluster themselves.
    uses_local_devices: ClassVar[bool] = True
    # Whether the (one) worker runs in the engine core's process and so shares the scheduler output's
    # objects: then a step may carry a grammar bitmask that is still being filled when it is launched.
    in_process: ClassVar[bool] = False

    def __init__(self, config: EngineConfig, plugins: Any, platform: Platform) -> None:
        self.config = config
        self.plugins = plugins
        self.platform = platform
        self.grid = RankGrid.from_config(config.parallel)

    @classmethod
    def validate_config(cls, config: EngineConfig, platform: Platform) -> None:
        """Called by `create_engine_config` once the platform is known: a world the executor cannot
        serve is a `ConfigError` naming the setting, never a silent fallback."""
        from keel.config import ConfigError

        world = config.parallel.world_size
        if cls.uses_local_devices and world > platform.device_count():
            raise ConfigError(
                f"tensor_parallel_size x pipeline_parallel_size x data_parallel_size = {world} ranks, but platform "
                f"{platform.name!r} offers {platform.device_count()} device(s) on this host; lower "
                "the parallel sizes (or use a multi-host executor such as 'ray')"
            )

    @property
    def world_size(self) -> int:
        return self.grid.world_size

    def collective_rpc(self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                       unique_reply_rank: int | None = None) -> list[Any]:
        """Call `Worker.<method>(*args, **kwargs)` on every rank; their results in rank order (with
        `unique_reply_rank`, only that rank sends its result back; the others' entries are None)."""
        raise NotImplementedError

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every rank; the output rank's (last pipeline stage, TP rank 0) result. Under data
        parallelism the step is a `DataParallelSchedulerOutput` and the result a `DataParallelRunnerOutput`
        (executors with more than one DP rank override this and `execute_model_async`; see `step_input`)."""
        if self.grid.dp_size > 1:
            raise NotImplementedError(f"the {type(self).__name__} executor does not run data-parallel replicas")
        rank = self.grid.output_rank
        return self.collective_rpc("execute_model", (scheduler_output,), unique_reply_rank=rank)[rank]

    def step_input(self, scheduler_output: Any, rank: int) -> SchedulerOutput:
        """What `rank` executes this step: its DP group's part of a `DataParallelSchedulerOutput`."""
        from keel.engine.scheduler_output import DataParallelSchedulerOutput

        if isinstance(scheduler_output, DataParallelSchedulerOutput):
            return scheduler_output.parts[self.grid.coords(rank).dp_rank]
        return scheduler_output

    def step_output(self, results: dict[int, Any]) -> Any:
        """The step's result from the output ranks' replies (rank -> `ModelRunnerOutput`): that one, or
        every DP replica's in a `DataParallelRunnerOutput`."""
        from keel.engine.scheduler_output import DataParallelRunnerOutput

        ranks = self.grid.output_ranks
        if len(ranks) == 1:
            return results[ranks[0]]
        return DataParallelRunnerOutput(tuple(results[r] for r in ranks))

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Any:
        """Launch one step; returns an object whose `get_output()` waits for it (async scheduling).
        The default runs the step at once."""
        return _Ready(self.execute_model(scheduler_output))

    def check_health(self) -> None:
        """Raise `WorkerDiedError` if a worker is gone; called by the engine core between steps."""

    def shutdown(self) -> None:
        """Stop every worker; idempotent."""


class _Ready:
    def __init__(self, output: Any) -> None:
        self._output = output

    def get_output(self) -> Any:
        return self._output
