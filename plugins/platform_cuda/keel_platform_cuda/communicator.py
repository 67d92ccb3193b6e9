"""NcclCommunicator: the collectives tensor parallelism needs, over torch.distributed's NCCL backend.

Named by `CudaPlatform.communicator()`; created once per worker process when the process groups are
set up (`NcclCommunicator.initialize`), or wrapped around an existing group. Every rank must call each
collective in the same order (NCCL's rule); tensors must live on this rank's device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class CommunicatorError(RuntimeError):
    """The communicator was used before initialization or with tensors on the wrong device."""


class NcclCommunicator:
    def __init__(self, group: Any = None, device: torch.device | None = None) -> None:
        """`group`: a torch.distributed group (None: the world), or the `GroupCoordinator` that
        keel.distributed builds this communicator for (its torch group; None there for a group of one)."""
        if not dist.is_initialized():
            raise CommunicatorError("torch.distributed is not initialized; call NcclCommunicator.initialize first")
        if hasattr(group, "rank_in_group"):  # a keel.distributed GroupCoordinator
            self.group, self.rank, self.world_size = group.torch_group, group.rank_in_group, group.world_size
        else:
            self.group = group
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        self.device = device or torch.device("cuda", torch.cuda.current_device())

    @classmethod
    def initialize(cls, rank: int, world_size: int, init_method: str, local_rank: int | None = None
                   ) -> NcclCommunicator:
        """Called once per worker: bind the local GPU, join the NCCL process group, return its communicator."""
        local = rank if local_rank is None else local_rank
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        if not dist.is_initialized():
            dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world_size,
                                    device_id=device)
        return cls(device=device)

    def _check(self, t: torch.Tensor) -> None:
        if t.device != self.device:
            raise CommunicatorError(f"tensor on {t.device}, but this rank's communicator is on {self.device}")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns `t` (row-parallel linear layers call this)."""
        self._check(t)
        if self.world_size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `t` along `dim` (the vocab-parallel logits call this)."""
        self._check(t)
        if self.world_size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._check(t)
        if self.world_size > 1:
            dist.broadcast(t, src=src, group=self.group)
        return t

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group, device_ids=[self.device.index])

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
