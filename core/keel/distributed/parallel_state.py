"""The process's rank grid and its groups: created once by the worker, read by layers.

The worker calls `init_distributed_environment` in `Worker.init_device` (before the model is built);
layers reach their groups through `get_tp_group()` / `get_pp_group()` / `get_ep_group()` (vLLM's names),
as vLLM does: a group is fixed for the process's life, unlike per-step metadata, which always travels
explicitly. Every rank creates every group in the same order (torch.distributed requires it).
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

from keel.distributed.grid import RankCoords, RankGrid
from keel.distributed.group import GroupCoordinator

logger = logging.getLogger("keel.distributed")

# How long a collective may wait for a peer before torch.distributed raises; the executor notices a
# dead rank long before (it watches the processes), this only bounds a hang the executor cannot see.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


@dataclass(frozen=True)
class DistributedState:
    grid: RankGrid
    rank: int
    coords: RankCoords
    tp: GroupCoordinator
    pp: GroupCoordinator
    dp: GroupCoordinator
    ep: GroupCoordinator


_STATE: DistributedState | None = None


def init_distributed_environment(grid: RankGrid, rank: int, communicator, init_method: str | None = None
                                 ) -> DistributedState:
    """Join the world (torch.distributed on `communicator.dist_backend`; skipped for a world of one
    without `init_method`, i.e. the "uni" executor) and
    build this rank's groups. `communicator` is the platform's `CommunicatorSpec`. Idempotent per process
    for the same grid and rank."""
    global _STATE
    if _STATE is not None:
        if (_STATE.grid, _STATE.rank) != (grid, rank):
            raise RuntimeError(f"this process is already rank {_STATE.rank} of {_STATE.grid}")
        return _STATE
    device_comm_cls = None
    # A multi-rank executor hands every worker a rendezvous, even for a world of one: that run goes
    # through the platform's communicator too (the one-device check of the NCCL path).
    joined = grid.world_size > 1 or init_method is not None
    if joined:
        import torch.distributed as dist

        if init_method is None:
            raise ValueError("a world of more than one rank needs an init_method (tcp://host:port)")
        if not dist.is_initialized():
            dist.init_process_group(backend=communicator.dist_backend, init_method=init_method,
                                    world_size=grid.world_size, rank=rank, timeout=COLLECTIVE_TIMEOUT)
        if communicator.device_communicator:
            from keel.plugins.registry import import_ref

            device_comm_cls = import_ref(communicator.device_communicator)

    def make(name: str, groups: list[list[int]]) -> GroupCoordinator:
        mine = None
        for ranks in groups:
            torch_group = None
            if joined and len(ranks) > 1:
                import torch.distributed as dist

                torch_group = dist.new_group(ranks)
            if rank in ranks:
                mine = GroupCoordinator(name, ranks, rank, torch_group)
        assert mine is not None
        if device_comm_cls is not None:
            mine.device_communicator = device_comm_cls(mine)
        return mine

    _STATE = DistributedState(grid=grid, rank=rank, coords=grid.coords(rank),
                              tp=make("tp", grid.tp_groups()), pp=make("pp", grid.pp_groups()),
                              dp=make("dp", grid.dp_groups()), ep=make("ep", grid.ep_groups()))
    if grid.world_size > 1:
        logger.info("rank %d of %s: %s", rank, grid, _STATE.coords)
    return _STATE


def destroy_distributed_environment() -> None:
    """Leave the world; called when a worker shuts down (and by tests)."""
    global _STATE
    _STATE = None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_state() -> DistributedState:
    if _STATE is None:
        raise RuntimeError("no tensor-parallel group: keel.distributed is not initialized in this process "
                           "(the worker's init_device creates the process groups before the model is built)")
    return _STATE


def get_tp_group() -> GroupCoordinator:
    return get_state().tp


def get_pp_group() -> GroupCoordinator:
    return get_state().pp


def get_dp_group() -> GroupCoordinator:
    return get_state().dp


def get_ep_group() -> GroupCoordinator:
    return get_state().ep
