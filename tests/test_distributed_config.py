"""Distribution settings are validated at startup (never ignored) and the rank grid is laid out as
documented; no process is started here."""

from __future__ import annotations

import argparse

import pytest
import torch

from keel.config import ConfigError, EngineArgs, ParallelConfig
from keel.distributed.communication_op import tensor_model_parallel_all_reduce
from keel.distributed.grid import RankGrid
from keel.distributed.group import GroupCoordinator
from keel.plugins.errors import UnknownKeyError


def _config(**kw):
    return EngineArgs(platform="cpu", **kw).create_engine_config(require_model=False)


def test_default_executor_is_uni_for_one_rank_and_mp_for_more():
    assert ParallelConfig().executor_backend == "uni"
    assert ParallelConfig(tensor_parallel_size=2).executor_backend == "mp"
    assert ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray").executor_backend == "ray"


def test_tensor_parallel_size_beyond_the_platforms_devices_is_a_startup_error():
    from keel_platform_cpu.platform import CpuPlatform

    too_many = CpuPlatform.max_ranks + 1
    with pytest.raises(ConfigError, match=rf"{too_many} ranks, but platform 'cpu' offers {CpuPlatform.max_ranks}"):
        _config(tensor_parallel_size=too_many)
    assert _config(tensor_parallel_size=2).parallel.world_size == 2


def test_settings_that_cannot_be_served_are_errors():
    with pytest.raises(ConfigError, match="'uni' runs one worker"):
        _config(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(UnknownKeyError, match="mp"):
        _config(distributed_executor_backend="nonesuch")
    with pytest.raises(ConfigError, match="enable_expert_parallel"):
        _config(enable_expert_parallel=True)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be a positive integer"):
        ParallelConfig(tensor_parallel_size=0)


def test_cli_flags_use_vllms_names():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
                            "--pipeline-parallel-size", "1", "--enable-expert-parallel"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.tensor_parallel_size, args.distributed_executor_backend, args.pipeline_parallel_size,
            args.enable_expert_parallel) == (2, "mp", 1, True)


def test_rank_grid_layout():
    grid = RankGrid(tp_size=2, pp_size=2, dp_size=2)
    assert grid.world_size == 8 and grid.ep_size == 4
    assert grid.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.pp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.ep_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    c = grid.coords(7)
    assert (c.tp_rank, c.pp_rank, c.dp_rank, c.ep_rank) == (1, 1, 1, 3)
    assert all(grid.rank_of(grid.coords(r).tp_rank, grid.coords(r).pp_rank, grid.coords(r).dp_rank) == r
               for r in range(8))
    assert RankGrid(tp_size=2, pp_size=2).output_rank == 2  # TP rank 0 of the last stage
    with pytest.raises(ValueError, match="outside"):
        grid.coords(8)


def test_a_group_of_one_is_the_identity_and_a_sharded_layer_refuses_it(monkeypatch):
    from keel.distributed import parallel_state

    group = GroupCoordinator("tp", [0], 0)
    x = torch.ones(3)
    assert group.all_reduce(x) is x and group.all_gather(x) is x
    state = parallel_state.DistributedState(RankGrid(), 0, RankGrid().coords(0), group, group, group, group)
    monkeypatch.setattr(parallel_state, "_STATE", state)
    assert tensor_model_parallel_all_reduce(x, 1) is x
    with pytest.raises(RuntimeError, match="sharded for 2 tensor-parallel ranks"):
        tensor_model_parallel_all_reduce(x, 2)
