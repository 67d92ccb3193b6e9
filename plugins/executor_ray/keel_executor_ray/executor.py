"""The "ray" executor: one Ray actor per rank, placed by Ray on the cluster's devices.

`distributed_executor_backend: ray` joins the running Ray cluster (`ray.init()`: $RAY_ADDRESS, else the
cluster `ray start` made on this host, else a new local one) unless this process is already connected.
It reserves one bundle per rank (one GPU on CUDA, one CPU on the CPU platform) in a placement group,
packed onto as few nodes as possible, so ranks of a TP group share a node where the cluster allows. A
cluster without enough devices is a startup error naming both numbers. torch.distributed meets at
rank 0's node. An actor that dies fails the call with `WorkerDiedError` naming the rank; the other
actors are killed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from keel.config import ConfigError
from keel.distributed.executor import Executor, WorkerDiedError, WorkerError

logger = logging.getLogger("keel.executor_ray")

PLACEMENT_TIMEOUT_S = 120.0


def _device_resource(platform) -> str:
    return "CPU" if platform.device_type == "cpu" else "GPU"


class RayExecutor(Executor):
    uses_local_devices = False  # the cluster's devices are checked at startup instead

    def __init__(self, config, plugins, platform) -> None:
        super().__init__(config, plugins, platform)
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from keel_executor_ray.actor import RayWorker

        self._dead: WorkerError | None = None
        self._closed = False
        if not ray.is_initialized():
            ray.init(log_to_driver=True)
        n = self.world_size
        resource = _device_resource(platform)
        total = int(ray.cluster_resources().get(resource, 0))
        if total < n:
            raise ConfigError(
                f"tensor_parallel_size x pipeline_parallel_size x data_parallel_size = {n} ranks, but the Ray "
                f"cluster has {total} "
                f"{resource}(s); add nodes or lower the parallel sizes"
            )
        self._pg = placement_group([{resource: 1}] * n, strategy="PACK")
        self._remove_pg = remove_placement_group
        self._actors: list[Any] = []
        try:
            ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise ConfigError(f"the Ray cluster could not place {n} bundles of one {resource} within "
                                  f"{PLACEMENT_TIMEOUT_S:.0f} s (are the devices in use?)")
            actor_cls = ray.remote(num_cpus=1 if resource == "CPU" else 0,
                                   num_gpus=1 if resource == "GPU" else 0)(RayWorker)
            self._actors = [
                actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank)).remote()
                for rank in range(n)
            ]
            ips = self._gather([a.node_ip.remote() for a in self._actors])
            port = self._gather([self._actors[0].free_port.remote()])[0]
            init_method = f"tcp://{ips[0]}:{port}"
            local = [ips[:rank].count(ip) for rank, ip in enumerate(ips)]
            self._gather([a.start.remote(config, rank, local[rank], ips.count(ips[rank]), init_method)
                          for rank, a in enumerate(self._actors)])
        except BaseException:
            self.shutdown()
            raise
        logger.info("ray executor: %d actors on nodes %s", n, sorted(set(ips)))

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Results in rank order; the first actor death or error fails the call (and the executor)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        if self._dead is not None:
            raise self._dead
        index = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            rank = index[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except RayActorError as exc:
                self._fail(WorkerDiedError(rank, f"worker rank {rank} (Ray actor) died: {exc}"))
            except RayTaskError as exc:
                self._died_first(grace_s=1.0)
                cause = exc.as_instanceof_cause()
                self._dead = WorkerError(rank, f"worker rank {rank} failed: {cause}")
                self.shutdown()
                if isinstance(cause, BaseException):
                    cause.add_note(f"(raised on worker rank {rank})")
                    raise cause from None
                raise self._dead from None
        return [results[r] for r in range(len(refs))]

    def _died_first(self, grace_s: float) -> None:
        # A peer's death makes the survivors' collectives fail: name the dead actor, not the survivor.
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        deadline = time.monotonic() + grace_s
        for rank, actor in enumerate(self._actors):
            try:
                ray.get(actor.node_ip.remote(), timeout=max(0.05, deadline - time.monotonic()))
            except RayActorError as exc:
                self._fail(WorkerDiedError(rank, f"worker rank {rank} (Ray actor) died: {exc}"))
            except GetTimeoutError:
                pass

    def _fail(self, error: WorkerError) -> None:
        self._dead = error
        self.shutdown()
        raise error

    def _launch(self, method: str, args: Sequence[Any] | Callable[[int], Sequence[Any]],
                kwargs: dict[str, Any] | None, reply_ranks: Collection[int] | None) -> list[Any]:
        """One call per actor; `args` may be a function of the rank; `reply_ranks` None: all reply."""
        if self._dead is not None:
            raise self._dead
        return [a.call.remote(method, tuple(args(rank) if callable(args) else args), dict(kwargs or {}),
                              reply_ranks is None or rank in reply_ranks)
                for rank, a in enumerate(self._actors)]

    def collective_rpc(self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                       unique_reply_rank: int | None = None) -> list[Any]:
        replies = None if unique_reply_rank is None else (unique_reply_rank,)
        return self._gather(self._launch(method, args, kwargs, replies))

    def execute_model(self, scheduler_output) -> Any:
        return self.execute_model_async(scheduler_output).get_output()

    def execute_model_async(self, scheduler_output) -> Any:
        refs = self._launch("execute_model", lambda rank: (self.step_input(scheduler_output, rank),), None,
                            self.grid.output_ranks)
        return _PendingStep(self, refs)

    @property
    def actors(self) -> list[Any]:
        return list(self._actors)

    def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        import ray

        for actor in self._actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 -- already gone
                pass
        try:
            self._remove_pg(self._pg)
        except Exception:  # noqa: BLE001 -- the cluster may be gone already
            pass


class _PendingStep:
    def __init__(self, executor: RayExecutor, refs: list[Any]) -> None:
        self._executor, self._refs = executor, refs

    def get_output(self) -> Any:
        return self._executor.step_output(dict(enumerate(self._executor._gather(self._refs))))
