"""RMSNorm with an optional fused residual add, numerically matching HF transformers."""

from __future__ import annotations

import torch
from torch import nn

from keel.models.weights import default_weight_loader, set_weight_attrs


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), the normalization computed in float32.

    `forward(x)` returns the normalized x. `forward(x, residual)` first adds the residual (in the
    input dtype, as HF does), returning `(normalized, new_residual)` so decoder layers can carry the
    un-normalized stream without an extra add.
    """

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
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
