"""RMSNorm with an optional fused residual add, numerically matching HF transformers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import nn

from keel.models.weights import default_weight_loader, set_weight_attrs


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), the normalization computed in float32.

    `forward(x)` returns the normalized x. `forward(x, residual)` first adds the residual (in the
    input dtype, as HF does), returning `(normalized, new_residual)` so decoder layers can carry the
    un-normalized stream without an extra add.

    `custom_ops` / `bound_ops`: the worker may bind fused kernels for these ops (see
    `keel.layers.custom_op`); an unbound op runs the torch math below. `fused_input_quant`: the quantized
    linear layer this norm feeds may have bound its activation quantization here (`keel.layers.input_quant`);
    steps of more than its `min_m` tokens then return a `QuantizedInput` in place of the normalized tensor.
    """

    custom_ops: ClassVar[tuple[str, ...]] = ("rms_norm", "fused_add_rms_norm")
    bound_ops: Mapping[str, Callable[..., Any]] = MappingProxyType({})
    input_quant_op: ClassVar[str] = "rms_norm"
    fused_input_quant: Any = None  # an InputQuantFusion, bound after loading

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        set_weight_attrs(self.weight, weight_loader=default_weight_loader)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., hidden_size]
        dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x32.to(dtype)

    def forward(
        self,
        x: torch.Tensor,  # [..., hidden_size]
        residual: torch.Tensor | None = None,  # [..., hidden_size]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        fused = self.fused_input_quant
        if fused is not None and x.numel() // x.shape[-1] > fused.min_m:
            out, new_residual = fused("rms_norm", x, residual, self.weight, self.variance_epsilon)
            return out if residual is None else (out, new_residual)
        if residual is None:
            op = self.bound_ops.get("rms_norm")
            return op(x, self.weight, self.variance_epsilon) if op is not None else self._norm(x)
        op = self.bound_ops.get("fused_add_rms_norm")
        if op is not None:
            return op(x, residual, self.weight, self.variance_epsilon)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
