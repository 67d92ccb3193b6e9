"""Pipeline parallelism: which layers a stage holds, what travels between stages, and the stage's
side of a step.

A model declaring `supports_pipeline_parallel` builds only its stage's layers (`get_pp_indices`, vLLM's
split: equal shares, the remainder to the last stages) and returns `IntermediateTensors` from every stage
but the last. The runner's `PipelineStage` receives the previous stage's tensors, runs the model and sends
its own on; only the last stage samples. The stages before it learn the sampled tokens from the scheduler
(`CachedRequestData.new_token_ids`) the next time the request is scheduled, so no stage ever waits for a
later one: with micro-batches (the engine core keeps `pipeline_parallel_size` steps of disjoint requests
in flight) stage 0 computes step N + 1 while stage 1 computes step N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keel.distributed.group import GroupCoordinator


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers stage `pp_rank` of `pp_size` holds."""
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot fill {pp_size} pipeline stages")
    base, extra = divmod(num_layers, pp_size)
    # The first stage also embeds and the last computes logits: the remainder goes to the middle-last.
    sizes = [base + (1 if i >= pp_size - extra else 0) for i in range(pp_size)]
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


@dataclass
class IntermediateTensors:
    """What one stage hands the next: the hidden states and the residual not yet added."""

    hidden: torch.Tensor  # [num_tokens, hidden_size]
    residual: torch.Tensor  # [num_tokens, hidden_size]


class PipelineStage:
    """This rank's stage; built by the worker, used by the model runner every step."""

    def __init__(self, group: GroupCoordinator, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.group = group
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device

    @property
    def is_last(self) -> bool:
        return self.group.is_last_rank

    def forward(self, model, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor | None:
        """The model on this stage's layers: hidden states on the last stage, None on the others."""
        g = self.group
        intermediate = None
        if not g.is_first_rank:
            shape = (input_ids.shape[0], self.hidden_size)
            src = g.rank_in_group - 1
            intermediate = IntermediateTensors(g.recv(shape, self.dtype, src, self.device),
                                               g.recv(shape, self.dtype, src, self.device))
        out = model(input_ids, positions, ctx, intermediate_tensors=intermediate)
        if g.is_last_rank:
            return out
        g.send(out.hidden, g.rank_in_group + 1)
        g.send(out.residual, g.rank_in_group + 1)
        return None

    def forward_alone(self, model, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor | None:
        """Like `forward` with zeros for the previous stage's tensors and nothing sent (profiling runs)."""
        intermediate = None
        if not self.group.is_first_rank:
            zeros = torch.zeros(input_ids.shape[0], self.hidden_size, dtype=self.dtype, device=self.device)
            intermediate = IntermediateTensors(zeros, zeros.clone())
        out = model(input_ids, positions, ctx, intermediate_tensors=intermediate)
        return out if self.is_last else None
