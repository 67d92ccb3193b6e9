"""How a FusedMoE layer's experts are spread over ranks (vLLM: FusedMoEParallelConfig).

Tensor parallel (the default with TP > 1): every rank holds every expert, each expert's intermediate
dimension split like a dense MLP. Expert parallel (`enable_expert_parallel`): rank r holds experts
[r * E / ep, (r + 1) * E / ep) whole. Either way a rank's output is a partial sum over the group that
the MoE block all-reduces -- with activations replicated across the TP group, that reduction is the
tokens' combine, and dispatch is each rank keeping the routes to its own experts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FusedMoEParallelConfig:
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0

    @classmethod
    def make(cls, tp_size: int, tp_rank: int, enable_expert_parallel: bool) -> FusedMoEParallelConfig:
        """Experts sharded over the TP ranks (EP group = TP group with one DP rank), or split by TP."""
        if enable_expert_parallel:
            return cls(ep_size=tp_size, ep_rank=tp_rank)
        return cls(tp_size=tp_size, tp_rank=tp_rank)

    @property
    def use_ep(self) -> bool:
        return self.ep_size > 1
