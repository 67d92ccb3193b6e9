"""FP8 linear layers computed in fp8 on the GPU: the weight stays e4m3 and is never dequantized per step.

Chosen once per layer after loading, from where the weight lives and what the scheme is, as a path for
large M (`choose_native`) and one for steps of at most SMALL_M_MAX_M tokens (`choose_small_m`), each with
why, logged once per model and reason by `NativeChoiceLog`; a step's M (tokens) is static per captured
CUDA graph, so the choice is fixed per graph bucket:
- "w8a8_small_m" (M <= small_m_plan.w8a8_max_m, schemes with activation scales): the Triton W8A8 small-M GEMM
  (`fp8_w8a8_small_m_triton`): fp8 x fp8 MMA, the weight rows as the MMA's M, the activations quantized
  in its prologue with the numbers `quantize_activations` gives -- the large-M paths' math, so a
  request's result does not depend on its step's batch size.
- "weight_only" (every M of a weight-only fp8 checkpoint; small M where "w8a8_small_m" does not fit,
  the reason logged): the fp8 weight widened in registers and multiplied with the model-dtype
  activations (`fp8_triton.fp8_weight_only_gemm`), the weight scale in the epilogue.
- "scaled_mm": per-channel (or per-tensor, kept per row) weights with per-token or static activations,
  bf16 activations, sizes multiples of 16 -> torch._scaled_mm with row-wise scales (cuBLASLt fp8, sm89+).
- "cublas_block": 128x128 block weights with per-token 128-input-group activations (DeepSeek-V3) on sm90,
  N and K multiples of 128 -> cuBLAS's block-scaled fp8 GEMM (`fp8_cublas_block`: F.scaled_mm, torch
  2.10+, checked by one probe GEMM per device at load).
- "triton": the block weights cuBLAS does not take (partial edge blocks, other blocks, other archs or
  torch), and the per-channel cases _scaled_mm does not take (fp16/fp32 activations, odd sizes) as one
  group per row -> `fp8_triton.fp8_gemm`.
- None: CPU weights, GPUs before sm89: the reference path.
The large-M W8A8 paths quantize activations in one Triton launch (`fp8_quant_triton.quant_fp8`), bit-equal
to the torch functions the reference rounds with.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from keel.layers.fp8_utils import per_token_group_quant_fp8
from keel_quantization import fp8_cublas_block, fp8_math
from keel_quantization.small_m_plan import w8a8_max_m

logger = logging.getLogger("keel.quantization.fp8")

_HAS_TRITON = importlib.util.find_spec("triton") is not None
# Largest M (tokens in a step) of the small-M path of a W8A8 layer: below it a GEMM is memory-bound on the
# weight, and the large-M paths (a quantization launch, then cuBLAS) cost ~2x the bytes' time at M = 1.
# The W8A8 small-M GEMM serves up to its measured bound (small_m_plan.w8a8_max_m: 8 per row, 16 per block),
# the weight-only GEMM (shapes the former does not take) up to this one.
SMALL_M_MAX_M = 32
# torch._scaled_mm's `use_fast_accum` on the "scaled_mm" path (per-token x per-channel / per-tensor W8A8, M past
# the small-M GEMM): the FP8 wgmma's running sum stays in the tensor core over K (~14 bits kept, DeepSeek-V3's
# report) instead of being promoted to float32 every few K steps. vLLM's sm_90 CUTLASS W8A8 GEMM takes the same
# schedule (KernelTmaWarpSpecializedPingpongFP8FastAccum) for M > 128. Measured on an H100 in one session
# (h100-fp8-fast-accum-9a71d88.json): Llama-8B's GEMMs at M 1024 / 8192 take 0.83-0.94x the time (~1.3 ->
# ~1.45 PFLOPS); their error against the exact product of the same e4m3 operands is 0.0021-0.0033 of the
# output's rms (exact accumulation: 0.0017, the bf16 output's rounding), where W8A8's own rounding of the
# operands is 0.037: +0.4% of that in quadrature. The 1024-request fp8 harness 26,085 / 26,291 -> 27,856 /
# 28,255 out tok/s (+7%), vLLM 22,600 / 22,739 beside it; the GPU engine-vs-reference tests pass with it.
FAST_ACCUM = True


def _block_k_fits(block: tuple[int, int] | None) -> bool:
    return block is None or block[1] <= 128 or block[1] % 128 == 0  # a Triton K tile lies in one group


@dataclass(frozen=True)
class NativeChoice:
    """A layer's path at large M or small M (None: the reference path) and why, for the load log."""

    path: str | None
    reason: str


def _capability(weight: torch.Tensor) -> tuple[int, int] | None:
    """The compute capability of the GPU holding `weight`; None for host weights."""
    return torch.cuda.get_device_capability(weight.device) if weight.is_cuda else None


def choose_native(weight: torch.Tensor, activation: str, block: tuple[int, int] | None,
                  dtype: torch.dtype) -> NativeChoice:
    """The GPU path for a loaded fp8 `weight` [N, K] at large M (see the module docstring)."""
    capability = _capability(weight)
    if capability is None or capability < (8, 9):
        where = "host weights" if capability is None else f"sm{capability[0]}{capability[1]} (fp8 MMA needs sm89+)"
        return NativeChoice(None, f"{where}: the reference path (dequantize, matmul)")
    n, k = weight.shape
    if activation == "none" or block is not None:  # Triton kernels only, or cuBLAS's block-scaled GEMM
        if not (_HAS_TRITON and _block_k_fits(block)):
            why = "no Triton" if not _HAS_TRITON else f"weight blocks {block} split a Triton K tile"
            return NativeChoice(None, f"{why}: the reference path")
        if activation == "none":
            return NativeChoice("weight_only", "a weight-only checkpoint: the Triton weight-only GEMM at every M")
        misfit = fp8_cublas_block.misfit(n, k, activation, block, dtype, capability) or fp8_cublas_block.probe(
            weight.device, dtype, (k // 128) % 4 != 0)
        if misfit is None:
            return NativeChoice("cublas_block", "cuBLAS's block-scaled fp8 GEMM (sm90, N and K multiples of 128)")
        return NativeChoice("triton", f"the Triton W8A8 block GEMM, not cuBLAS's: {misfit}")
    if dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0:
        return NativeChoice("scaled_mm", "torch._scaled_mm with row-wise scales (bf16, sizes multiples of 16)")
    if _HAS_TRITON:
        return NativeChoice("triton", f"the Triton W8A8 GEMM ({dtype}, [N, K] = [{n}, {k}]: not _scaled_mm's)")
    return NativeChoice(None, "no Triton, and _scaled_mm does not take this layer: the reference path")


def native_scale(path: str | None, weight_scale: torch.Tensor) -> torch.Tensor:
    """The weight scale `native_linear` takes on `path`, made once after loading (cuBLAS's padded block
    scales; the scale itself elsewhere)."""
    return fp8_cublas_block.weight_scales(weight_scale) if path == "cublas_block" else weight_scale


class NativeChoiceLog:
    """One model's fp8 layer paths: each distinct (path, reason) is logged once, naming the first layer
    that took it (a model's configs own one; layers built alone get their own)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.layers: dict[NativeChoice, list[str]] = {}  # choice -> layer prefixes, in loading order

    def record(self, prefix: str, shape: tuple[int, ...], choice: NativeChoice) -> None:
        layers = self.layers.setdefault(choice, [])
        if not layers:
            logger.info("%s: layer %s %s and the layers like it take %s: %s", self.method, prefix or "(unnamed)",
                        list(shape), choice.path or "no GPU kernel", choice.reason)
        layers.append(prefix)


def choose_small_m(native: str | None, activation: str, block: tuple[int, int] | None,
                   k: int) -> tuple[NativeChoice | None, int]:
    """The path of steps of at most the returned M tokens (None, 0: every M takes `native`)."""
    if native in (None, "weight_only") or not _HAS_TRITON or not _block_k_fits(block):  # _scaled_mm without Triton
        return None, 0
    from keel_quantization.fp8_w8a8_small_m_triton import misfit

    why = misfit(k)
    if why is not None:
        return NativeChoice("weight_only", f"M <= {SMALL_M_MAX_M}: the weight-only GEMM, not the W8A8 small-M one "
                            f"({why}): results at these M differ from the large-M path's"), SMALL_M_MAX_M
    max_m = min(SMALL_M_MAX_M, w8a8_max_m(block is None))
    if max_m == 0:
        return None, 0
    return NativeChoice("w8a8_small_m", f"M <= {max_m}: the Triton W8A8 small-M GEMM ({activation} "
                        "activations quantized in it, as at large M)"), max_m


def quantize_activations(x: torch.Tensor, activation: str, block: tuple[int, int] | None,
                         input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, groups]): per token and group, per token, or static."""
    if _HAS_TRITON:  # one launch; the same numbers as the torch functions below
        from keel_quantization.fp8_quant_triton import quant_fp8

        group = block[1] if activation == "dynamic_group" else x.shape[1]
        return quant_fp8(x, group, input_scale.float().reshape(1) if activation == "static" else None)
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
    # float32 [N] (per row) or [ceil(N / bn), ceil(K / bk)] (block); "cublas_block": native_scale()'s
    weight_scale: torch.Tensor,
    activation: str,
    block: tuple[int, int] | None,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    # per-row weight scales are one scale group over all of K
    group_n, group_k = block if block is not None else (1, x.shape[1])
    groups = weight_scale if block is not None else weight_scale.reshape(-1, 1)
    if path == "weight_only":
        from keel_quantization.fp8_triton import fp8_weight_only_gemm

        out = fp8_weight_only_gemm(x, weight, groups, group_n, group_k)
        return out if bias is None else out + bias
    if path == "w8a8_small_m":  # quantizes the activations itself, in its prologue
        from keel_quantization.fp8_w8a8_small_m_triton import fp8_w8a8_small_m_gemm

        out = fp8_w8a8_small_m_gemm(x, weight, groups, group_n, group_k, activation, input_scale)
        return out if bias is None else out + bias
    if path == "cublas_block":  # quantizes the activations itself, in the layout cuBLAS reads
        out = fp8_cublas_block.gemm(x, weight, weight_scale)
        return out if bias is None else out + bias
    a_q, a_s = quantize_activations(x, activation, block, input_scale)
    return quantized_linear(path, a_q, a_s, x.shape[0], weight, weight_scale, block, bias, x.dtype)


def quantized_linear(
    path: str,  # "scaled_mm", "triton" or "cublas_block"
    # e4m3 [M', K]: the activations, quantized (`quantize_activations`, `fp8_cublas_block.quantize_activations`, or
    # by their producer); rows past m are padding (cuBLAS's layout), which the other paths read past
    a_q: torch.Tensor,
    a_s: torch.Tensor,  # float32 [M', groups], any strides
    m: int,  # the real rows
    weight: torch.Tensor,  # e4m3 [N, K]
    weight_scale: torch.Tensor,  # `native_scale(path, ...)`: float32 [N] (per row) or the block scales
    block: tuple[int, int] | None,
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,  # the model dtype
) -> torch.Tensor:  # [m, N] in out_dtype
    """The large-M W8A8 GEMM on activations already quantized as its path reads them."""
    if path == "cublas_block":
        out = fp8_cublas_block.gemm_quantized(a_q, a_s, m, weight, weight_scale, out_dtype)
        return out if bias is None else out + bias
    a_q, a_s = a_q[:m], a_s[:m]
    if path == "scaled_mm":
        out = torch._scaled_mm(a_q, weight.t(), scale_a=a_s, scale_b=weight_scale.reshape(1, -1),
                               out_dtype=out_dtype, use_fast_accum=FAST_ACCUM)
    else:
        from keel_quantization.fp8_triton import fp8_gemm

        group_n, group_k = block if block is not None else (1, a_q.shape[1])
        groups = weight_scale if block is not None else weight_scale.reshape(-1, 1)
        out = fp8_gemm(a_q, a_s, weight, groups, group_n, group_k, out_dtype)
    return out if bias is None else out + bias
