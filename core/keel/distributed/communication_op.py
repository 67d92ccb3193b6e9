"""Collectives layers call (vLLM's names); they act on this process's tensor-parallel group.

`tp_size` is the size the calling layer was built for: a layer sharded for 2 ranks in a process whose
TP group has 1 (or none) must fail rather than return a partial sum.
"""

from __future__ import annotations

import torch

from keel.distributed.group import GroupCoordinator
from keel.distributed.parallel_state import get_tp_group


def _tp_group(tp_size: int | None) -> GroupCoordinator:
    group = get_tp_group()
    if tp_size is not None and group.world_size != tp_size:
        raise RuntimeError(f"a layer sharded for {tp_size} tensor-parallel ranks runs in a process whose "
                           f"tensor-parallel group has {group.world_size}")
    return group


def tensor_model_parallel_all_reduce(x: torch.Tensor, tp_size: int | None = None) -> torch.Tensor:
    return _tp_group(tp_size).all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1, tp_size: int | None = None) -> torch.Tensor:
    return _tp_group(tp_size).all_gather(x, dim)
