"""The pre-norm decoder block and stack shared by the Llama family and DeepSeek.

A model subclass builds the parts (attribute names match HF checkpoints); the forward passes are here:

    layer: input_layernorm -> self_attn(positions, hidden, ctx) -> post_attention_layernorm -> mlp
    stack: embed_tokens -> layers -> norm

Under pipeline parallelism a stack holds only layers [start_layer, end_layer) (the others are
`PPMissingLayer`s, so parameter names keep their global layer index); only the first stage embeds, only
the last applies the final norm, and the others return `IntermediateTensors` for the next stage.

The residual add of each sub-block is deferred into the next norm (`RMSNorm(x, residual)` is the fused
add + norm), so a layer passes `(hidden, residual)` on and the stack's final norm adds the last one.
"""

from __future__ import annotations

import torch
from torch import nn

from keel.distributed.pipeline import IntermediateTensors, get_pp_indices
from keel.forward_context import ForwardContext


class PPMissingLayer(nn.Module):
    """Stands in for a module another pipeline stage holds (no parameters, never called)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another pipeline stage")


class PreNormDecoderLayer(nn.Module):
    """Base of a model's decoder layer; the subclass sets `self_attn`, `mlp`, `input_layernorm` and
    `post_attention_layernorm` in its `__init__`."""

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]; None for the first layer
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (mlp output, residual), both [num_tokens, hidden_size]
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        # An mlp that needs the step's metadata (a MoE gathering tokens across DP ranks) declares it.
        if getattr(self.mlp, "takes_forward_context", False):
            return self.mlp(hidden, ctx), residual
        return self.mlp(hidden), residual


class DecoderStack(nn.Module):
    """Base of a model's `model` module; the subclass sets `embed_tokens`, `layers` (of
    `PreNormDecoderLayer`s) and `norm` in its `__init__`."""

    embed_tokens: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    start_layer: int = 0
    end_layer: int | None = None  # None: all layers (one stage)
    is_last_stage: bool = True

    def make_layers(self, num_layers: int, pp_rank: int, pp_size: int, make) -> nn.ModuleList:
        """`make(i)` for this stage's layers, `PPMissingLayer` for the others; sets the stage fields."""
        self.start_layer, self.end_layer = get_pp_indices(num_layers, pp_rank, pp_size)
        self.is_last_stage = pp_rank == pp_size - 1
        return nn.ModuleList(make(i) if self.start_layer <= i < self.end_layer else PPMissingLayer()
                             for i in range(num_layers))

    def local_layers(self) -> list[nn.Module]:
        return list(self.layers)[self.start_layer:self.end_layer]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        ctx: ForwardContext,
        intermediate_tensors: IntermediateTensors | None = None,  # from the previous stage, if any
    ) -> torch.Tensor | IntermediateTensors:  # [num_tokens, hidden_size] on the last stage
        if intermediate_tensors is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate_tensors.hidden, intermediate_tensors.residual
        for layer in self.local_layers():
            hidden, residual = layer(positions, hidden, residual, ctx)
        if not self.is_last_stage:
            return IntermediateTensors(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden
