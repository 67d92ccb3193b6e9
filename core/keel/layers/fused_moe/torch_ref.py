"""The torch reference path of the MoE expert computation (any device, any dtype).

`fused_experts_torch` is what `FusedMoE` runs where Triton is not available, and what the Triton kernel
is tested against. Experts are visited one at a time; only experts that received tokens do any work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from keel.layers.activation import get_act_and_mul_fn


def fused_experts_torch(
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden_size]: gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden_size, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    activation: str = "silu",
    *,
    expert_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    quantize_input: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:  # [num_tokens, hidden_size], dtype of hidden
    """sum_j topk_weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, j].

    Quantized experts (a quantization method's reference path): `expert_weights(e)` returns expert e's
    dequantized (w13 [2I, H], w2 [H, I]) in hidden's dtype (w13 / w2 are then not read), called only for
    experts with work; `quantize_input(x)` rounds each GEMM's input as the quantized kernel does (fp8
    activations: through fp8 and back)."""
    act = get_act_and_mul_fn(activation)
    out = torch.zeros_like(hidden)
    flat_ids = topk_ids.reshape(-1)
    # One host sync for the whole layer: which experts have work.
    for e in torch.unique(flat_ids).tolist():
        token_idx, slot = torch.where(topk_ids == e)
        x = hidden.index_select(0, token_idx)
        w13_e, w2_e = (w13[e], w2[e]) if expert_weights is None else expert_weights(e)
        if quantize_input is None:
            y = act(x @ w13_e.t()) @ w2_e.t()  # [n_e, hidden_size]
        else:
            y = quantize_input(act(quantize_input(x) @ w13_e.t())) @ w2_e.t()
        y = y * topk_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out
