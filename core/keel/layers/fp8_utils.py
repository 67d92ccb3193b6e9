"""FP8 (e4m3) activation quantization in plain torch, shared by every quantized path that needs it.

Per-token-group quantization is DeepSeek-V3's activation scheme for block-FP8 weights (and vLLM's
`per_token_group_quant_fp8`): each token's inputs in groups of `group` get their own scale, so a
request's numbers never depend on the other requests in its batch. The fused-MoE kernels of any plugin
and the torch reference quantize their GEMM inputs with this one function, so both round identically.
"""

from __future__ import annotations

import math

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Smallest scale: an all-zero row or group quantizes to zeros instead of dividing by zero (as vLLM).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def dynamic_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax (float32) -> the fp8 scale amax / 448, at least MIN_SCALE, by IEEE division on every device:
    torch's CUDA division by a Python scalar multiplies by its reciprocal (1 ulp off for some amax), which
    the GPU kernels' div_rn and the CPU's division would not match."""
    return (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)


def per_token_group_quant_fp8(
    x: torch.Tensor,  # [tokens, k]
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # (fp8 [tokens, k], float32 scales [tokens, ceil(k / group)])
    """Real value = fp8 value * scale of its group; a partial last group is scaled by its own elements.
    No host sync (graph-capturable)."""
    t, k = x.shape
    kb = math.ceil(k / group)
    xf = x.float()
    if kb * group != k:
        xf = torch.nn.functional.pad(xf, (0, kb * group - k))
    g = xf.view(t, kb, group)
    scale = dynamic_scale(g.abs().amax(dim=-1))  # [t, kb]
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(t, kb * group)[:, :k], scale


def dequant_per_token_group(q: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """fp8 [tokens, k] and scales [tokens, ceil(k / group)] -> [tokens, k] in `dtype`."""
    k = q.shape[1]
    return (q.float() * scale.repeat_interleave(group, dim=1)[:, :k]).to(dtype)
