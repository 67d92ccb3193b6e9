"""keel.distributed: the rank grid, its process groups and collectives, and the executors.

- `grid.RankGrid`: ranks <-> (TP, PP, DP, EP) coordinates.
- `parallel_state`: the process's groups (`get_tp_group()`, ...), created by `Worker.init_device`.
- `group.GroupCoordinator`: one group's collectives through the platform's communicator.
- `executor.Executor`: how the engine core drives its workers (`executor` registry kind: "uni", "mp";
  plugins add others such as "ray").
"""

from keel.distributed.communication_op import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from keel.distributed.grid import RankCoords, RankGrid
from keel.distributed.parallel_state import (
    get_dp_group,
    get_ep_group,
    get_pp_group,
    get_tp_group,
    init_distributed_environment,
)

__all__ = ["RankCoords", "RankGrid", "get_dp_group", "get_ep_group", "get_pp_group", "get_tp_group",
           "init_distributed_environment", "tensor_model_parallel_all_gather", "tensor_model_parallel_all_reduce"]
