"""FP8 (e4m3) quantize / dequantize in plain torch: the reference path and the test quantizer share it.

Scales follow the checkpoint convention: real value = fp8 value * scale (DeepSeek's `weight_scale_inv`
means the same multiplication despite its name).
"""

from __future__ import annotations

import math

import torch

from keel.layers.fp8_utils import (FP8, FP8_MAX, MIN_SCALE, dequant_per_token_group, dynamic_scale,
                                   per_token_group_quant_fp8)

__all__ = ["FP8", "FP8_MAX", "MIN_SCALE"]


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, saturated to the e4m3 range, rounded to fp8 (`scale` broadcasts against x)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (fp8 tensor, scalar float32 scale)."""
    scale = dynamic_scale(w.abs().amax().float())
    return to_fp8(w, scale), scale


def quantize_per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] -> (fp8 [rows, cols], float32 scale [rows])."""
    scale = dynamic_scale(w.abs().amax(dim=-1).float())
    return to_fp8(w, scale[..., None]), scale


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Block scales [ceil(rows/bn), ceil(cols/bk)] -> one scale per element [rows, cols] (edges cropped)."""
    bn, bk = block
    return scale.repeat_interleave(bn, 0)[: shape[0]].repeat_interleave(bk, 1)[:, : shape[1]]


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] -> (fp8 [rows, cols], float32 scale [ceil(rows/bn), ceil(cols/bk)]); partial edge
    blocks (576 rows in 128-row blocks) take the scale of the elements they have."""
    bn, bk = block
    rows, cols = w.shape
    nb, kb = math.ceil(rows / bn), math.ceil(cols / bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w.float()
    amax = padded.abs().view(nb, bn, kb, bk).amax(dim=(1, 3))
    scale = dynamic_scale(amax)
    return to_fp8(w, expand_blocks(scale, block, (rows, cols))), scale


def dequantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor:
    """fp8 w [rows, cols] with a per-row [rows] or block scale -> dense [rows, cols] in `dtype`."""
    if block is not None:
        full = expand_blocks(scale, block, tuple(w.shape))
    else:
        full = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(1, 1)
    return (w.float() * full).to(dtype)


def fake_quant_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Activations through a static per-tensor fp8 quantization and back (x's shape and dtype)."""
    return (to_fp8(x, scale).float() * scale).to(x.dtype)


def fake_quant_per_token(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, k] through dynamic per-token fp8 quantization and back."""
    q, scale = quantize_per_row(x)
    return (q.float() * scale[:, None]).to(x.dtype)


def fake_quant_per_token_group(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [tokens, k] through dynamic per-token, per-`group`-inputs fp8 quantization and back (DeepSeek-V3's
    activation scheme for block FP8); a partial last group is quantized on its own elements."""
    q, scale = per_token_group_quant_fp8(x, group)
    return dequant_per_token_group(q, scale, group, x.dtype)
