"""Gated activations for MLPs whose gate and up projections are stacked in one matmul."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:], the SwiGLU gate of Llama-family MLPs (gate first, then up).

    The worker may bind a fused `silu_and_mul` kernel (see `keel.layers.custom_op`); the quantized linear
    layer it feeds may bind its activation quantization (`fused_input_quant`, see `keel.layers.input_quant`):
    steps of more than its `min_m` tokens then return a `QuantizedInput`.
    """

    custom_ops: ClassVar[tuple[str, ...]] = ("silu_and_mul",)
    bound_ops: Mapping[str, Callable[..., Any]] = MappingProxyType({})
    input_quant_op: ClassVar[str] = "silu_and_mul"
    fused_input_quant: Any = None  # an InputQuantFusion, bound after loading

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, 2 * d] -> [num_tokens, d]
        fused = self.fused_input_quant
        if fused is not None and x.numel() // x.shape[-1] > fused.min_m:
            return fused("silu_and_mul", x)
        op = self.bound_ops.get("silu_and_mul")
        if op is not None:
            return op(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(nn.Module):
    """gelu(x[..., :d]) * x[..., d:] (GeGLU); `approximate` as in torch ("none" or "tanh")."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, 2 * d] -> [num_tokens, d]
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


class UnsupportedActivationError(ValueError):
    """The model config names an activation keel has no gated implementation for."""


_ACT_AND_MUL = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu": GeluAndMul,
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
}


def get_act_and_mul_fn(name: str) -> nn.Module:
    """The gated activation for HF `hidden_act` name `name` (used by model builders)."""
    try:
        return _ACT_AND_MUL[name.lower()]()
    except KeyError:
        raise UnsupportedActivationError(
            f"hidden_act {name!r} is not supported for gated MLPs; known: {sorted(_ACT_AND_MUL)}"
        ) from None
