"""Quantization method "fp8": vLLM's FP8 checkpoint layout, and online FP8 of an unquantized checkpoint.

config.json `quantization_config` fields:
- `activation_scheme`: "dynamic" (default; per-token scales, per token and 128-input group with block
  weights) or "static" (each layer's `input_scale`).
- `weight_block_size`: [bn, bk] for block FP8 (DeepSeek-V3: [128, 128]; scales `weight_scale_inv`
  [ceil(out/bn), ceil(in/bk)]); absent: `weight_scale` per tensor or per output channel.
- `fmt`: "e4m3" (the only format served).
- `ignored_layers` / `modules_to_not_convert`: modules left unquantized.

`quantization="fp8"` on an unquantized checkpoint quantizes every linear layer at load (per output
channel, dynamic per-token activations); routed experts then stay in the model dtype (logged).

Routed experts (FusedMoE) of a checkpoint are served in block FP8 (`fp8_moe`), kept in e4m3.

On a GPU the linear layers' fp8 GEMM per M is chosen at load (`fp8_native`); 128x128 block layers on
sm90 whose N and K are multiples of 128 take cuBLAS's block-scaled GEMM (`fp8_cublas_block`), the others
the Triton block GEMM. The config's `native_choices` logs each distinct choice, with its reason, once.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from keel.quantization import LinearLayerSpec, MoELayerSpec, QuantizationError, QuantizationRequest
from keel_quantization.config_fields import (
    check_fields,
    experts_skipped,
    float_dtype_reasons,
    is_layer_skipped,
)
from keel_quantization.fp8_linear import Fp8LinearMethod, Fp8Scheme
from keel_quantization.fp8_moe import Fp8MoEMethod
from keel_quantization.fp8_native import NativeChoiceLog

logger = logging.getLogger("keel.quantization.fp8")


def validate_fp8(request: QuantizationRequest) -> list[str]:
    """Where FP8 layers can run: the reference path is plain torch (fp8 storage, dequantize, matmul), so any
    device; activations in a float dtype."""
    return float_dtype_reasons(request.dtype)


class Fp8Config:
    """Registered as `fp8` under the `quantization` kind."""

    name: ClassVar[str] = "fp8"

    def __init__(self, scheme: Fp8Scheme, ignored_layers: tuple[str, ...] = ()) -> None:
        self.scheme = scheme
        self.ignored_layers = ignored_layers
        self.packed_modules_mapping: dict[str, list[str]] = {}
        self.native_choices = NativeChoiceLog(self.name)  # this model's fp8 layer paths, logged once each

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        check_fields(cls.name, config, ("activation_scheme", "weight_block_size", "fmt", "ignored_layers",
                                        "modules_to_not_convert"))
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise QuantizationError(f"fp8: quantization_config.fmt {fmt!r} is not served; only 'e4m3'")
        activation = config.get("activation_scheme", "dynamic")
        if activation not in ("static", "dynamic"):
            raise QuantizationError(f"fp8: activation_scheme {activation!r} is not 'static' or 'dynamic'")
        block = config.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, list | tuple) and len(block) == 2
                    and all(isinstance(b, int) and b > 0 for b in block)):
                raise QuantizationError(f"fp8: weight_block_size must be two positive integers, got {block!r}")
            if activation != "dynamic":
                raise QuantizationError("fp8: block-wise weights (weight_block_size) need activation_scheme 'dynamic'")
            scheme = Fp8Scheme("dynamic_group", tuple(block), "weight_scale_inv")
        else:
            scheme = Fp8Scheme("static" if activation == "static" else "dynamic_token")
        ignored = [*(config.get("ignored_layers") or ()), *(config.get("modules_to_not_convert") or ())]
        return cls(scheme, tuple(ignored))

    @classmethod
    def from_online(cls) -> Fp8Config:
        """`quantization="fp8"` on an unquantized checkpoint."""
        return cls(Fp8Scheme("dynamic_token", serialized=False))

    def validate(self, request: QuantizationRequest) -> list[str]:
        return validate_fp8(request)

    def get_quant_method(self, layer: LinearLayerSpec) -> Fp8LinearMethod | None:
        if is_layer_skipped(self.name, layer.prefix, self.ignored_layers, self.packed_modules_mapping):
            return None
        return Fp8LinearMethod(self.scheme, self.name, self.native_choices)

    def get_moe_method(self, spec: MoELayerSpec) -> Fp8MoEMethod | None:
        return fp8_moe_method(self.name, self.scheme, spec, self.ignored_layers, self.packed_modules_mapping)


def fp8_moe_method(method: str, scheme: Fp8Scheme, spec: MoELayerSpec, ignored: tuple[str, ...],
                   packed: dict[str, list[str]]) -> Fp8MoEMethod | None:
    """The routed experts' method for an FP8 scheme: block FP8 with per-token-group activations (None when
    the experts are left unquantized); other schemes are an error naming the layer."""
    if experts_skipped(method, spec, ignored, packed):
        return None
    if not scheme.serialized:
        logger.info("%s: online fp8 quantizes linear layers; the routed experts of %s stay in the model dtype",
                    method, spec.prefix)
        return None
    if scheme.block is None or scheme.activation != "dynamic_group":
        raise QuantizationError(
            f"{method}: routed experts of {spec.prefix} are FP8 with activation scheme {scheme.activation!r} and "
            f"weight blocks {scheme.block}; fused-MoE kernels serve block FP8 experts (weight_block_size, dynamic "
            "per-token-group activations) only"
        )
    return Fp8MoEMethod(scheme.block, scheme.scale_name, method)
