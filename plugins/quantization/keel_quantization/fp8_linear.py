"""FP8 linear layers: weights stored in e4m3 with per-tensor, per-channel or block scales.

One method serves every FP8 checkpoint layout (vLLM's "fp8", compressed-tensors' W8A8-FP8, online
quantization); an `Fp8Scheme` says what the checkpoint holds:

- per-tensor / per-channel weights: `weight` fp8 [out, in] and a scale that is a scalar per checkpoint
  shard or one per output row. Both are kept as one float32 scale per row [out], so a fused layer's
  shards keep their own scales exactly (no requantization to a shared maximum).
- block weights (DeepSeek-V3): scales [ceil(out/bn), ceil(in/bk)] under `weight_scale_inv` (vLLM "fp8")
  or `weight_scale` (compressed-tensors); a partial last block (576 rows in 128-row blocks) is allowed
  where the dimension is not split or stacked.
- activations: static per-tensor (`input_scale` per shard; a fused layer uses the largest, as vLLM),
  dynamic per token, dynamic per token and `bk`-input group (block FP8), or none (weight-only).

Forward on a GPU (sm89+): fp8 GEMMs on the stored weight (`fp8_native`: the Triton W8A8 small-M GEMM for
small M, torch._scaled_mm, cuBLAS's block-scaled GEMM or the Triton W8A8 GEMM above; weight-only
checkpoints the weight-only Triton GEMM), chosen once after loading and logged once per model and reason
(the config's `NativeChoiceLog`). Elsewhere, the reference path: activations go through their fp8
quantization and back, the weight is dequantized, then one matmul -- the same numbers an fp8 GEMM
computes, up to summation order. Dynamic scales are per token, never per batch, and every path quantizes
activations alike, so a request's result does not depend on the other requests in the batch (up to
float32 summation order; a layer whose small-M step falls back to the weight-only GEMM is the exception,
logged at load).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from keel.layers.input_quant import QuantizedInput
from keel.quantization import LinearLayerSpec, QuantizationError
from keel_quantization import fp8_math
from keel_quantization.fp8_cublas_block import ROWS_MULTIPLE
from keel_quantization.fp8_native import (
    _HAS_TRITON,
    NativeChoiceLog,
    choose_native,
    choose_small_m,
    native_linear,
    native_scale,
    quantized_linear,
)
from keel_quantization.loading import add_param, load_per_shard, load_row_scale, load_sharded

ACTIVATIONS = ("static", "dynamic_token", "dynamic_group", "none")
# the large-M paths that quantize activations in a launch of their own, which a producer may take over
_PREQUANTIZED_PATHS = ("scaled_mm", "triton", "cublas_block")


@dataclass(frozen=True)
class Fp8Scheme:
    activation: str  # one of ACTIVATIONS
    block: tuple[int, int] | None = None  # (rows, cols) per weight scale block; None: per tensor/channel
    scale_name: str = "weight_scale"  # the weight scale's checkpoint name
    serialized: bool = True  # False: the checkpoint is unquantized; quantize (per channel) after loading

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise QuantizationError(f"fp8 activation scheme {self.activation!r} is not one of {ACTIVATIONS}")
        if self.activation == "dynamic_group" and self.block is None:
            raise QuantizationError("fp8 per-token-group activations need block weights")


class Fp8LinearMethod:
    """Created per layer by an FP8 config's `get_quant_method`; see the module docstring."""

    def __init__(self, scheme: Fp8Scheme, method_name: str, choices: NativeChoiceLog | None = None) -> None:
        self.scheme = scheme
        self.method_name = method_name
        self.choices = choices or NativeChoiceLog(method_name)  # the model's, shared by its layers
        self.prefix = ""
        self.params_dtype = torch.float32
        self.native: str | None = None  # the GPU path chosen after loading (fp8_native), None: reference
        self.native_scale: torch.Tensor | None = None  # the weight scale as `native` takes it
        self.small_m: str | None = None  # the path of steps of at most small_m_max_m tokens (fp8_native)
        self.small_m_max_m = 0

    def _check_blocks(self, module: torch.nn.Module, layer: LinearLayerSpec) -> None:
        bn, bk = self.scheme.block
        sizes = layer.output_partition_sizes
        split_out = len(sizes) > 1 or module.tp_size > 1 and module.output_size_per_partition != module.output_size
        if split_out and any(s % bn for s in sizes):
            raise QuantizationError(
                f"{self.method_name}: layer {layer.prefix} has output slices {sizes}, not all multiples of the "
                f"weight block's {bn} rows; a partial block is possible only in an unsplit, unstacked layer"
            )
        if module.input_size_per_partition != module.input_size and layer.input_size % bk:
            raise QuantizationError(
                f"{self.method_name}: layer {layer.prefix} splits its {module.input_size} inputs into "
                f"{layer.input_size} per rank, not a multiple of the weight block's {bk} columns"
            )

    def create_weights(self, module: torch.nn.Module, layer: LinearLayerSpec) -> None:
        self.params_dtype = layer.params_dtype
        self.prefix = layer.prefix
        out, k = sum(layer.output_partition_sizes), layer.input_size
        s = self.scheme
        if not s.serialized:  # online: a dense weight now, fp8 after loading
            add_param(module, "weight", torch.empty(out, k, dtype=layer.params_dtype), load_sharded, in_dim=1)
            return
        add_param(module, "weight", torch.empty(out, k, dtype=fp8_math.FP8), load_sharded, in_dim=1,
                  dtype=fp8_math.FP8)
        if s.block is not None:
            self._check_blocks(module, layer)
            bn, bk = s.block
            scale = torch.empty(math.ceil(out / bn), math.ceil(k / bk), dtype=torch.float32)
            add_param(module, s.scale_name, scale, load_sharded, in_dim=1, out_unit=bn, in_unit=bk)
        else:
            add_param(module, s.scale_name, torch.empty(out, dtype=torch.float32), load_row_scale)
        if s.activation == "static":
            add_param(module, "input_scale", torch.empty(len(layer.output_partition_sizes), dtype=torch.float32),
                      load_per_shard)

    def process_weights_after_loading(self, module: torch.nn.Module) -> None:
        s = self.scheme
        if not s.serialized:
            q, scale = fp8_math.quantize_per_row(module.weight.data)
            module.weight = torch.nn.Parameter(q, requires_grad=False)
            module.register_parameter(s.scale_name, torch.nn.Parameter(scale, requires_grad=False))
        if s.activation == "static":
            scale = module.input_scale.data.amax().reshape(1)
            module.input_scale = torch.nn.Parameter(scale, requires_grad=False)
        choice = choose_native(module.weight, s.activation, s.block, self.params_dtype)
        self.choices.record(self.prefix, tuple(module.weight.shape), choice)
        self.native = choice.path
        self.native_scale = native_scale(self.native, getattr(module, s.scale_name).data)
        small, self.small_m_max_m = choose_small_m(self.native, s.activation, s.block, module.weight.shape[1])
        if small is not None:
            self.choices.record(self.prefix, tuple(module.weight.shape), small)
        self.small_m = None if small is None else small.path

    def dequantize_weight(self, module: torch.nn.Module) -> torch.Tensor:  # [out, in] in the model dtype
        return fp8_math.dequantize(module.weight, getattr(module, self.scheme.scale_name), self.scheme.block,
                                   self.params_dtype)

    def quantize_input(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:  # [t, k] -> [t, k]
        act = self.scheme.activation
        if act == "static":
            return fp8_math.fake_quant_static(x, module.input_scale)
        if act == "dynamic_token":
            return fp8_math.fake_quant_per_token(x)
        if act == "dynamic_group":
            return fp8_math.fake_quant_per_token_group(x, self.scheme.block[1])
        return x

    def input_quant_fusion(self, module: torch.nn.Module) -> Fp8InputFusion | None:
        """Called once after loading (`keel.layers.input_quant.bind_input_quant`): the producer of this layer's
        input may quantize it as this layer's large-M path reads it -- per token, static, or per token and
        `bk`-input group (row-major for the Triton GEMM, cuBLAS's padded token-major layout for its block-scaled
        GEMM). Steps of at most `small_m_max_m` tokens keep their own path (it quantizes in its prologue)."""
        s, static = self.scheme, None
        if self.native not in _PREQUANTIZED_PATHS or s.activation == "none" or not _HAS_TRITON:
            return None
        if s.activation == "dynamic_group":
            group = s.block[1]
            if group & (group - 1):  # the fused kernels' groups are power-of-two tiles
                return None
            pad_to = ROWS_MULTIPLE if self.native == "cublas_block" else 1
            return Fp8InputFusion(self.small_m_max_m, None, group, pad_to)
        if s.activation == "static":
            static = module.input_scale.float().reshape(1)
        return Fp8InputFusion(self.small_m_max_m, static)

    def apply(
        self,
        module: torch.nn.Module,
        x: torch.Tensor | QuantizedInput,  # [num_tokens, input_size]
        bias: torch.Tensor | None = None,  # [output_size]
    ) -> torch.Tensor:  # [num_tokens, output_size]
        if isinstance(x, QuantizedInput):  # from the producer bound to input_quant_fusion's, past small_m_max_m
            return quantized_linear(self.native, x.values, x.scales, x.num_tokens, module.weight, self.native_scale,
                                    self.scheme.block, bias, x.dtype)
        x2 = x.reshape(-1, x.shape[-1])
        if self.native is not None:  # chosen for CUDA weights only (tests set it to run kernels interpreted)
            s = self.scheme
            path = self.small_m if x2.shape[0] <= self.small_m_max_m else self.native
            scale = self.native_scale if path == "cublas_block" else getattr(module, s.scale_name)
            out = native_linear(path, x2, module.weight, scale, s.activation, s.block,
                                getattr(module, "input_scale", None), bias)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        out = F.linear(self.quantize_input(module, x2), self.dequantize_weight(module).to(x.dtype), bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])


@dataclass(frozen=True)
class Fp8InputFusion:
    """`keel.layers.input_quant.InputQuantFusion` for a W8A8 fp8 layer: its producer writes e4m3 activations and
    their scales (per token, the layer's static scale, or per `group` inputs; rows padded to `pad_to`) with
    `fp8_input_fusion_triton`'s kernels."""

    min_m: int
    static_scale: torch.Tensor | None  # float32 [1]; None: dynamic
    group: int | None = None  # inputs per dynamic scale; None: one per token
    pad_to: int = 1  # > 1: cuBLAS's block-scaled layout (rows padded, scales token-major)

    def merge(self, other: object) -> Fp8InputFusion | None:
        """Layers sharing one producer share its output: the same scales (per token, per group, or one static
        scale), rows padded as far as any of them asks (cuBLAS's block layout; the Triton GEMM reads the real rows
        of it through its strides)."""
        if not isinstance(other, Fp8InputFusion) or self.group != other.group:
            return None
        mine, theirs = self.static_scale, other.static_scale
        if (mine is None) != (theirs is None) or mine is not None and not torch.equal(mine, theirs):
            return None
        return replace(self, min_m=max(self.min_m, other.min_m), pad_to=max(self.pad_to, other.pad_to))

    def supports(self, op: str, width: int) -> bool:
        from keel_quantization.fp8_input_fusion_triton import MAX_NORM_WIDTH

        return op == "silu_and_mul" or op == "rms_norm" and width <= MAX_NORM_WIDTH

    def __call__(self, op: str, *args):
        from keel_quantization import fp8_input_fusion_triton as k

        if op == "rms_norm":
            x, residual, weight, eps = args
            x2 = x.reshape(-1, x.shape[-1])
            r2 = None if residual is None else residual.reshape(-1, residual.shape[-1])
            q, s, res = k.rms_norm_quant(x2, r2, weight, eps, self.static_scale, self.group, self.pad_to)
            out_dtype = torch.promote_types(weight.dtype, x.dtype if res is None else res.dtype)  # as the norm's
            return (QuantizedInput(q, s, out_dtype, x2.shape[0]),
                    None if res is None else res.view(residual.shape))
        (x,) = args
        x2 = x.reshape(-1, x.shape[-1])
        q, s = k.silu_and_mul_quant(x2, self.static_scale, group=self.group, pad_to=self.pad_to)
        return QuantizedInput(q, s, x.dtype, x2.shape[0])
