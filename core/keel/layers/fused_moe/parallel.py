"""How a FusedMoE layer's experts are spread over ranks (vLLM: FusedMoEParallelConfig).

Tensor parallel (the default with TP > 1): every rank holds every expert, each expert's intermediate
dimension split like a dense MLP. Expert parallel (`enable_expert_parallel`): rank r of the EP group
(TP x DP ranks) holds experts [r * E / ep, (r + 1) * E / ep) whole. Either way a rank's output is a
partial sum over the group that the MoE block all-reduces -- with activations replicated across the TP
group, that reduction is the tokens' combine, and dispatch is each rank keeping the routes to its own
experts. With DP > 1 (attention data parallel) the block first gathers every DP rank's tokens, so each
rank's experts see all of them, and takes its own rows back from the reduced sum. Without EP, each DP
replica splits its experts over its own TP ranks only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FusedMoEParallelConfig:
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    dp_size: int = 1  # > 1: tokens are gathered over the DP ranks to the experts (EP only)
    dp_rank: int = 0

    @classmethod
    def make(cls, tp_size: int, tp_rank: int, enable_expert_parallel: bool, dp_size: int = 1,
             dp_rank: int = 0) -> FusedMoEParallelConfig:
        """Experts sharded over the TP x DP ranks (the grid's EP group: rank dp_rank * tp_size + tp_rank),
        or split by TP within each DP replica."""
        if enable_expert_parallel:
            return cls(ep_size=tp_size * dp_size, ep_rank=dp_rank * tp_size + tp_rank, dp_size=dp_size,
                       dp_rank=dp_rank)
        return cls(tp_size=tp_size, tp_rank=tp_rank)

    @property
    def use_ep(self) -> bool:
        return self.ep_size > 1
