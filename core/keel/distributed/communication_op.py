"""Collectives layers call (vLLM's names); they act on this process's tensor-, data- or expert-parallel
group.

`tp_size` / `size` is the group size the calling layer was built for: a layer sharded for 2 ranks in a
process whose group has 1 (or none) must fail rather than return a partial sum.
"""

from __future__ import annotations

import torch

from keel.distributed.group import GroupCoordinator
from keel.distributed.parallel_state import get_dp_group, get_ep_group, get_tp_group


def _checked(group: GroupCoordinator, size: int | None, what: str) -> GroupCoordinator:
    if size is not None and group.world_size != size:
        raise RuntimeError(f"a layer sharded for {size} {what} ranks runs in a process whose "
                           f"{what} group has {group.world_size}")
    return group


def tensor_model_parallel_all_reduce(x: torch.Tensor, tp_size: int | None = None) -> torch.Tensor:
    return _checked(get_tp_group(), tp_size, "tensor-parallel").all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1, tp_size: int | None = None) -> torch.Tensor:
    return _checked(get_tp_group(), tp_size, "tensor-parallel").all_gather(x, dim)


def data_parallel_all_gather(x: torch.Tensor, dim: int = 0, size: int | None = None) -> torch.Tensor:
    """Every DP rank's `x` concatenated along `dim` in DP rank order (equal shapes on every rank)."""
    return _checked(get_dp_group(), size, "data-parallel").all_gather(x, dim)


def expert_parallel_all_reduce(x: torch.Tensor, size: int | None = None) -> torch.Tensor:
    return _checked(get_ep_group(), size, "expert-parallel").all_reduce(x)
