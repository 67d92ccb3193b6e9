"""FP8 linear layers computed in fp8 on the GPU: the weight stays e4m3 and is never dequantized per step.

Chosen once per layer after loading (`choose_native`), from where the weight lives and what the scheme is:
- "scaled_mm": per-channel (or per-tensor, kept per row) weights with per-token or static activations,
  bf16 activations, sizes multiples of 16 -> torch._scaled_mm with row-wise scales (cuBLASLt fp8, sm89+).
- "triton": block weights with per-token-group activations (DeepSeek-V3), and the per-channel cases
  _scaled_mm does not take (fp16/fp32 activations, odd sizes) as one group per row -> `fp8_triton.fp8_gemm`.
- None: weight-only fp8 (no activation scheme), CPU weights, GPUs before sm89: the reference path.
Activations are quantized in torch (`per_token_group_quant_fp8`, per row, or the static scale), the same
functions the reference rounds with.
"""

from __future__ import annotations

import importlib.util

import torch

from keel.layers.fp8_utils import per_token_group_quant_fp8
from keel_quantization import fp8_math


def choose_native(weight: torch.Tensor, activation: str, block: tuple[int, int] | None,
                  dtype: torch.dtype) -> str | None:
    """The GPU path for a loaded fp8 `weight` [N, K] (see the module docstring)."""
    if not weight.is_cuda or activation == "none" or torch.cuda.get_device_capability(weight.device) < (8, 9):
        return None
    has_triton = importlib.util.find_spec("triton") is not None
    n, k = weight.shape
    if block is not None:
        bk = block[1]
        return "triton" if has_triton and (bk <= 128 or bk % 128 == 0) else None
    if dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0:
        return "scaled_mm"
    return "triton" if has_triton else None


def quantize_activations(x: torch.Tensor, activation: str, block: tuple[int, int] | None,
                         input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, groups]): per token and group, per token, or static."""
    if activation == "dynamic_group":
        return per_token_group_quant_fp8(x, block[1])
    if activation == "dynamic_token":
        q, scale = fp8_math.quantize_per_row(x)
        return q, scale[:, None]
    q = fp8_math.to_fp8(x, input_scale)
    return q, input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()


def native_linear(
    path: str,
    x: torch.Tensor,  # [M, K] in the model dtype
    weight: torch.Tensor,  # e4m3 [N, K]
    weight_scale: torch.Tensor,  # float32 [N] (per row) or [ceil(N / bn), ceil(K / bk)] (block)
    activation: str,
    block: tuple[int, int] | None,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    a_q, a_s = quantize_activations(x, activation, block, input_scale)
    if path == "scaled_mm":
        out = torch._scaled_mm(a_q, weight.t(), scale_a=a_s, scale_b=weight_scale.reshape(1, -1),
                               out_dtype=x.dtype)
    else:
        from keel_quantization.fp8_triton import fp8_gemm

        if block is not None:
            out = fp8_gemm(a_q, a_s, weight, weight_scale, block[0], block[1], x.dtype)
        else:  # one scale group over all of K: per-row weight scales, per-token activation scales
            out = fp8_gemm(a_q, a_s, weight, weight_scale.reshape(-1, 1), 1, x.shape[1], x.dtype)
    return out if bias is None else out + bias
