"""Block-FP8 routed experts (DeepSeek-V3's released layout), kept in e4m3 in memory.

Checkpoint, per expert and projection: `weight` e4m3 [out, in] and its block scales [ceil(out / bn),
ceil(in / bk)] (`weight_scale_inv` in vLLM's "fp8" layout, `weight_scale` in compressed-tensors').
Stacked as `w13_weight` [E, 2I, H] + `w13_<scale>` [E, 2I / bn, ceil(H / bk)] (gate blocks, then up
blocks: I must be a multiple of bn) and `w2_weight` [E, H, I] + `w2_<scale>`. Activations: dynamic per
token and bk-input group, as the checkpoint's linear layers. Forward: the bound `fused_experts` kernel
(dequantizing inside the grouped GEMM) or the reference here: only experts with work are dequantized,
each GEMM input goes through its fp8 rounding and back. On a GPU the kernels quantize the GEMM inputs
with this plugin's fused kernels (`fp8_quant_triton`; silu(gate) * up and its quantization in one launch,
`fp8_input_fusion_triton`), handed over in the `FusedMoEQuantConfig`.
"""

from __future__ import annotations

import importlib.util
import math

import torch

from keel.layers.fused_moe.quant_config import FusedMoEQuantConfig
from keel.quantization import MoELayerSpec, QuantizationError
from keel_quantization import fp8_math
from keel_quantization.moe_loading import add_expert_param, apply_experts


def input_quantizer(weight: torch.Tensor):
    """The fused Triton activation quantizer for experts on a GPU (bit-equal to the torch function the
    kernels otherwise call); None elsewhere."""
    if not weight.is_cuda or importlib.util.find_spec("triton") is None:
        return None
    from keel_quantization.fp8_quant_triton import quant_fp8

    return quant_fp8


def gated_input_quantizer(weight: torch.Tensor, group: int):
    """The down GEMM's input of silu experts, silu(gate) * up quantized in one launch (bit-equal to the silu
    kernel, then `input_quantizer`'s): this plugin's fused kernel on a GPU for groups of a power of two; None
    elsewhere."""
    if input_quantizer(weight) is None or group & (group - 1):
        return None
    from keel_quantization.fp8_input_fusion_triton import silu_and_mul_quant

    return lambda gate_up, group: silu_and_mul_quant(gate_up, None, group=group)


class Fp8MoEMethod:
    """Created per FusedMoE layer by the fp8 / compressed-tensors configs' `get_moe_method`."""

    def __init__(self, block: tuple[int, int], scale_name: str, method_name: str) -> None:
        self.block = block
        self.scale_name = scale_name
        self.method_name = method_name
        self._quant: FusedMoEQuantConfig | None = None

    def create_weights(self, layer: torch.nn.Module, spec: MoELayerSpec) -> None:
        bn, bk = self.block
        e, h, i = spec.local_num_experts, spec.hidden_size, spec.intermediate_size_per_partition
        if i % bn or (i != layer.intermediate_size and i % bk):
            raise QuantizationError(
                f"{self.method_name}: {spec.prefix} has an intermediate size of {i} per rank, not a multiple of the "
                f"weight block {self.block} (gate and up stack into one weight; down's inputs split by rank)"
            )
        fp8, f32 = fp8_math.FP8, torch.float32
        common = {"out_dim": 0, "in_dim": 1}
        add_expert_param(layer, "w13_weight", torch.empty(e, 2 * i, h, dtype=fp8), True, dtype=fp8, **common)
        add_expert_param(layer, f"w13_{self.scale_name}", torch.empty(e, 2 * i // bn, math.ceil(h / bk), dtype=f32),
                         True, out_unit=bn, in_unit=bk, **common)
        add_expert_param(layer, "w2_weight", torch.empty(e, h, i, dtype=fp8), False, dtype=fp8, **common)
        add_expert_param(layer, f"w2_{self.scale_name}", torch.empty(e, math.ceil(h / bn), math.ceil(i / bk), dtype=f32),
                         False, out_unit=bn, in_unit=bk, **common)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._quant = None  # rebuilt from the loaded parameters on first use

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> FusedMoEQuantConfig:
        if self._quant is None:
            self._quant = FusedMoEQuantConfig("fp8_block", getattr(layer, f"w13_{self.scale_name}"),
                                              getattr(layer, f"w2_{self.scale_name}"), block_shape=self.block,
                                              quantize_input=input_quantizer(layer.w13_weight),
                                              quantize_gated_input=gated_input_quantizer(layer.w13_weight,
                                                                                         self.block[1]))
        return self._quant

    def apply(
        self,
        layer: torch.nn.Module,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
        topk_ids: torch.Tensor,  # [num_tokens, top_k]
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]
        fused_experts: object,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        quant, dtype, block = self.get_fused_moe_quant_config(layer), hidden.dtype, self.block

        def weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (fp8_math.dequantize(layer.w13_weight[e], quant.w13_scale[e], block, dtype),
                    fp8_math.dequantize(layer.w2_weight[e], quant.w2_scale[e], block, dtype))

        return apply_experts(layer, layer.w13_weight, layer.w2_weight, quant, hidden, topk_weights, topk_ids, residual,
                             fused_experts, weights, lambda x: fp8_math.fake_quant_per_token_group(x, block[1]))
