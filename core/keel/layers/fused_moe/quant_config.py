"""How a quantized `FusedMoE` stores its experts: the `quant` argument of the `fused_experts` custom op.

Built by the layer's quantization method after loading (`get_fused_moe_quant_config`); a kernel provider
reads it at bind time (`supports_layer`: does it implement this kind?) and on every call. Frozen: fields
are only ever added.

Kinds:
- "fp8_block": w13 / w2 in e4m3, `w13_scale` [E, ceil(2I / bn), ceil(H / bk)] and `w2_scale`
  [E, ceil(H / bn), ceil(I / bk)] (real weight = fp8 value * its block's scale; DeepSeek-V3's
  `weight_scale_inv`); each GEMM's input quantized per token and `bk`-input group
  (`keel.layers.fp8_utils.per_token_group_quant_fp8`), as the checkpoint's dynamic activation scheme says;
  `quantize_input`, when the method gives one, computes those same numbers faster (a fused kernel of the
  method's plugin: `(x [M, K], group) -> (e4m3 [M, K], float32 scales [M, ceil(K / group)])`) and kernel
  providers call it instead. `quantize_gated_input`, when given, does the same for the down GEMM's input of silu
  experts straight from the w13 GEMM's output: `(gate_up [M, 2I], group)` -> the e4m3 values and scales of
  silu(gate) * up as the unfused silu kernel rounds it (to gate_up's dtype) and `quantize_input` quantizes it,
  bit for bit, in one launch; a kernel provider whose gated activation runs as a step of its own between the
  GEMMs calls it instead of that step and `quantize_input`.
- "int4": weight-only 4-bit (GPTQ / AWQ after repacking): `w13` int32 [E, H / 8, 2I] and `w2` int32
  [E, I / 8, H] packed along the input (input k in bits 4 * (k % 8) of word k // 8), `w*_scale` and
  `w*_zeros` [E, groups, N] in the model dtype (real weight = (q - zero) * scale), `w*_g_idx` int32
  [E, K] (each input's group; any order, GPTQ's desc_act).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

KINDS = ("fp8_block", "int4")


@dataclass(frozen=True)
class FusedMoEQuantConfig:
    kind: str  # one of KINDS
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    block_shape: tuple[int, int] | None = None  # fp8_block: (bn, bk) weight block; bk is the activation group
    w13_zeros: torch.Tensor | None = None  # int4
    w2_zeros: torch.Tensor | None = None
    w13_g_idx: torch.Tensor | None = None
    w2_g_idx: torch.Tensor | None = None
    quantize_input: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None = None  # fp8_block
    quantize_gated_input: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None = None  # silu

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"FusedMoEQuantConfig kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "fp8_block" and self.block_shape is None:
            raise ValueError("fp8_block experts need block_shape")
        if self.kind == "int4" and any(t is None for t in (self.w13_zeros, self.w2_zeros, self.w13_g_idx,
                                                             self.w2_g_idx)):
            raise ValueError("int4 experts need zeros and g_idx for both projections")
