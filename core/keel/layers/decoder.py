"""The pre-norm decoder block and stack shared by the Llama family and DeepSeek.

A model subclass builds the parts (attribute names match HF checkpoints); the forward passes are here:

    layer: input_layernorm -> self_attn(positions, hidden, ctx) -> post_attention_layernorm -> mlp
    stack: embed_tokens -> layers -> norm

The residual add of each sub-block is deferred into the next norm (`RMSNorm(x, residual)` is the fused
add + norm), so a layer passes `(hidden, residual)` on and the stack's final norm adds the last one.
"""

from __future__ import annotations

import torch
from torch import nn

from keel.forward_context import ForwardContext


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
        return self.mlp(hidden), residual


class DecoderStack(nn.Module):
    """Base of a model's `model` module; the subclass sets `embed_tokens`, `layers` (of
    `PreNormDecoderLayer`s) and `norm` in its `__init__`."""

    embed_tokens: nn.Module
    layers: nn.ModuleList
    norm: nn.Module

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden
