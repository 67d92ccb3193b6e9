"""RankGrid: how global ranks map onto tensor-, pipeline-, data- and expert-parallel coordinates.

Layout (vLLM's): rank = (dp_rank * pp_size + pp_rank) * tp_size + tp_rank, so the ranks of one TP group
are consecutive (one host's devices, the fastest links). The expert-parallel group of a pipeline stage
is every rank of that stage across DP and TP (with DP 1: the TP group).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankCoords:
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int


@dataclass(frozen=True)
class RankGrid:
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "dp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RankGrid.{name} must be a positive integer, got {value!r}")

    @classmethod
    def from_config(cls, parallel) -> RankGrid:
        """The grid of a `keel.config.ParallelConfig`."""
        return cls(tp_size=parallel.tensor_parallel_size, pp_size=parallel.pipeline_parallel_size,
                   dp_size=parallel.data_parallel_size)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def ep_size(self) -> int:
        return self.tp_size * self.dp_size

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        tp_rank = rank % self.tp_size
        pp_rank = (rank // self.tp_size) % self.pp_size
        dp_rank = rank // (self.tp_size * self.pp_size)
        return RankCoords(tp_rank, pp_rank, dp_rank, dp_rank * self.tp_size + tp_rank)

    def rank_of(self, tp_rank: int = 0, pp_rank: int = 0, dp_rank: int = 0) -> int:
        return (dp_rank * self.pp_size + pp_rank) * self.tp_size + tp_rank

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, p, d) for t in range(self.tp_size)]
                for d in range(self.dp_size) for p in range(self.pp_size)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, p, d) for p in range(self.pp_size)]
                for d in range(self.dp_size) for t in range(self.tp_size)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, p, d) for d in range(self.dp_size)]
                for p in range(self.pp_size) for t in range(self.tp_size)]

    def ep_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, p, d) for d in range(self.dp_size) for t in range(self.tp_size)]
                for p in range(self.pp_size)]

    @property
    def output_rank(self) -> int:
        """The rank whose step output the engine core reads: TP rank 0 of the last pipeline stage."""
        return self.rank_of(0, self.pp_size - 1, 0)

    @property
    def output_ranks(self) -> list[int]:
        """The output rank of every data-parallel replica, in DP rank order."""
        return [self.rank_of(0, self.pp_size - 1, d) for d in range(self.dp_size)]
