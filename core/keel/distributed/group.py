"""GroupCoordinator: one process group (TP, PP, DP or EP) and its collectives, as vLLM names them.

Collectives go through the platform's communicator: a torch.distributed group on the platform's
`dist_backend` (gloo on the CPU, NCCL on CUDA), or the platform's own `device_communicator` (a
"module:attr" class built with this coordinator) where it names one -- so a vendor's platform brings
its own. A group of one rank needs no torch.distributed at all: every collective is the identity.
"""

from __future__ import annotations

from typing import Any

import torch


class GroupCoordinator:
    def __init__(self, name: str, ranks: list[int], rank: int, torch_group: Any = None,
                 device_communicator: Any = None) -> None:
        self.name = name
        self.ranks = list(ranks)
        self.rank = rank  # global rank of this process
        self.rank_in_group = self.ranks.index(rank)
        self.world_size = len(self.ranks)
        self.torch_group = torch_group
        self.device_communicator = device_communicator

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group (in place where the backend can); returns the summed tensor."""
        if self.device_communicator is not None:  # the platform's, even for one rank (it checks devices)
            return self.device_communicator.all_reduce(x)
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.torch_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in group-rank order."""
        if self.device_communicator is not None:  # the platform's, even for one rank (it checks devices)
            return self.device_communicator.all_gather(x, dim)
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.torch_group)
        return torch.cat(parts, dim=dim)

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Point-to-point send to group rank `dst` (pipeline stages)."""
        import torch.distributed as dist

        dist.send(x.contiguous(), dst=self.ranks[dst], group=self.torch_group)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, device: torch.device) -> torch.Tensor:
        import torch.distributed as dist

        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, src=self.ranks[src], group=self.torch_group)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`x` of group rank `src` on every rank (in place)."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dist.broadcast(x, src=self.ranks[src], group=self.torch_group)
        return x

    def __repr__(self) -> str:
        return f"GroupCoordinator({self.name}, ranks={self.ranks}, rank_in_group={self.rank_in_group})"
