"""What the 4-bit configs (GPTQ, AWQ) share: where they run, and which layers their module list selects."""

from __future__ import annotations

from typing import ClassVar

from keel.quantization import LinearLayerSpec, MoELayerSpec, QuantizationRequest
from keel_quantization.config_fields import experts_skipped, float_dtype_reasons, is_layer_skipped
from keel_quantization.int4_linear import Int4Format, Int4LinearMethod
from keel_quantization.int4_moe import Int4MoEMethod


def validate_int4(request: QuantizationRequest) -> list[str]:
    """The reference path runs on any device; the Triton GEMM serves CUDA devices."""
    reasons = float_dtype_reasons(request.dtype)
    if reasons:
        return reasons
    if request.device_type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return ["the 4-bit GEMM on CUDA needs triton (pip install triton)"]
    return []


class Int4Config:
    """Base of the registered 4-bit configs. `names`: module names from the config (None: all layers);
    `names_skip`: whether listed layers stay unquantized (AWQ's modules_to_not_convert) or are the only
    quantized ones (GPTQ's modules_in_block_to_quantize)."""

    name: ClassVar[str]

    def __init__(self, fmt: Int4Format, names: tuple[str, ...] | None, names_skip: bool) -> None:
        self.fmt = fmt
        self.names = names
        self.names_skip = names_skip
        self.packed_modules_mapping: dict[str, list[str]] = {}

    def validate(self, request: QuantizationRequest) -> list[str]:
        return validate_int4(request)

    def get_quant_method(self, layer: LinearLayerSpec) -> Int4LinearMethod | None:
        if self.names is not None:
            listed = is_layer_skipped(self.name, layer.prefix, self.names, self.packed_modules_mapping)
            if listed == self.names_skip:
                return None
        return Int4LinearMethod(self.fmt)

    def get_moe_method(self, spec: MoELayerSpec) -> Int4MoEMethod | None:
        if self.names is not None:
            listed = experts_skipped(self.name, spec, self.names, self.packed_modules_mapping)
            if listed == self.names_skip:
                return None
        return Int4MoEMethod(self.fmt)
