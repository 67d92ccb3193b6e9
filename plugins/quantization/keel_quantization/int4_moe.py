"""4-bit routed experts (GPTQ / AWQ checkpoints), weight-only, kept packed in memory.

Checkpoint, per expert and projection, as the linear layers store them (`int4_math`): GPTQ `qweight`
[in / 8, out], `qzeros` [groups, out / 8], `scales` [groups, out], `g_idx` [in]; AWQ `qweight`
[in, out / 8] (interleaved), `qzeros`, `scales`. Loaded stacked (`w13_qweight`, ... gate then up along the
outputs); after loading both formats become the runtime form the `fused_experts` op reads
(`FusedMoEQuantConfig` kind "int4"): `w13_qweight` int32 [E, H / 8, 2I] and `w2_qweight` [E, I / 8, H]
packed along the input, `w*_zeros` / `w*_scales` [E, groups, N] in the model dtype, `w*_g_idx` [E, K].
Forward: the bound kernel (dequantizing tiles inside the grouped GEMM) or the reference here, which
dequantizes only the experts with work.
"""

from __future__ import annotations

import math

import torch

from keel.layers.fused_moe.quant_config import FusedMoEQuantConfig
from keel.quantization import MoELayerSpec, QuantizationError
from keel_quantization import int4_dummy, int4_math
from keel_quantization.int4_linear import Int4Format
from keel_quantization.moe_loading import add_expert_param, apply_experts, frozen

PACK = int4_math.PACK


class Int4MoEMethod:
    """Created per FusedMoE layer by the GPTQ / AWQ configs' `get_moe_method`."""

    def __init__(self, fmt: Int4Format) -> None:
        self.fmt = fmt
        self.params_dtype = torch.float32
        self._quant: FusedMoEQuantConfig | None = None

    def _group(self, k: int) -> int:
        return k if self.fmt.group_size == -1 else self.fmt.group_size

    def create_weights(self, layer: torch.nn.Module, spec: MoELayerSpec) -> None:
        f = self.fmt
        e, h, i = spec.local_num_experts, spec.hidden_size, spec.intermediate_size_per_partition
        split = i != layer.intermediate_size
        g13, g2 = self._group(h), self._group(layer.intermediate_size)
        if h % PACK or i % PACK or (split and (i % g2 or f.desc_act)):
            raise QuantizationError(
                f"{f.method}: {spec.prefix} has hidden {h} and intermediate {i} per rank; 4-bit experts need both "
                f"multiples of {PACK}" + (f", the intermediate of the group size {g2} and no desc_act when split"
                                         " across tensor-parallel ranks" if split else "")
            )
        self.params_dtype = spec.params_dtype
        i32 = torch.int32
        for w13, k, n, group in ((True, h, 2 * i, g13), (False, i, h, g2)):
            p = "w13_" if w13 else "w2_"
            groups = math.ceil(k / group)
            if f.method == "gptq":
                add_expert_param(layer, p + "qweight", torch.zeros(e, k // PACK, n, dtype=i32), w13, dtype=i32,
                                 out_dim=1, in_dim=0, in_unit=PACK)
                add_expert_param(layer, p + "g_idx", torch.zeros(e, 2 if w13 else 1, k, dtype=i32), w13, dtype=i32,
                                 out_dim=None, in_dim=0, per_shard=True)
            else:
                add_expert_param(layer, p + "qweight", torch.zeros(e, k, n // PACK, dtype=i32), w13, dtype=i32,
                                 out_dim=1, out_unit=PACK, in_dim=0)
            add_expert_param(layer, p + "qzeros", torch.zeros(e, groups, n // PACK, dtype=i32), w13, dtype=i32,
                             out_dim=1, out_unit=PACK, in_dim=0, in_unit=group)
            add_expert_param(layer, p + "scales", torch.zeros(e, groups, n, dtype=torch.float16), w13,
                             out_dim=1, in_dim=0, in_unit=group)
            first = 0 if w13 else layer.parallel.tp_rank * i  # this rank's first checkpoint input
            int4_dummy.mark(layer, **{p + "qweight": int4_dummy.random_words, p + "qzeros": int4_dummy.random_words,
                                      p + "scales": int4_dummy.scales(h if w13 else layer.intermediate_size)},
                            **({p + "g_idx": int4_dummy.group_ids(group, first)} if f.method == "gptq" else {}))

    def _runtime(self, layer: torch.nn.Module, p: str) -> None:
        """Replace projection `p`'s checkpoint tensors by the runtime form (see the module docstring)."""
        f = self.fmt
        qweight, qzeros, scales = (getattr(layer, p + n).data for n in ("qweight", "qzeros", "scales"))
        e, groups, n = scales.shape
        order = None if f.method == "gptq" else int4_math.AWQ_ORDER
        zeros = int4_math.unpack_cols(qzeros.reshape(e * groups, -1), order).view(e, groups, n) + f.zero_offset
        if f.method == "gptq":
            g_idx = getattr(layer, p + "g_idx").data
            if not bool((g_idx == g_idx[:, :1]).all()):
                raise QuantizationError(f"gptq: the gate and up projections of experts in {layer.prefix} have "
                                        "different g_idx (input orders); keel needs them equal")
            g_idx = g_idx[:, 0]
            if p == "w2_" and layer.intermediate_size_per_partition != layer.intermediate_size:
                g_idx = g_idx - layer.parallel.tp_rank * groups  # checkpoint groups -> this rank's
            delattr(layer, p + "g_idx")
        else:
            k = qweight.shape[1]
            g_idx = (torch.arange(k, dtype=torch.int32, device=qweight.device) // self._group(k)).expand(e, k)
            qweight = torch.stack([int4_math.pack_rows(int4_math.unpack_cols(q, order)) for q in qweight])
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise QuantizationError(f"{f.method}: {layer.prefix}.{p}g_idx names groups outside 0..{groups - 1}")
        delattr(layer, p + "qzeros")
        layer.register_parameter(p + "qweight", frozen(qweight))
        layer.register_parameter(p + "zeros", frozen(zeros.to(self.params_dtype)))
        layer.register_parameter(p + "scales", frozen(scales.to(self.params_dtype)))
        layer.register_parameter(p + "g_idx", frozen(g_idx.to(torch.int32)))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        for p in ("w13_", "w2_"):
            self._runtime(layer, p)
        self._quant = None

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> FusedMoEQuantConfig:
        if self._quant is None:
            self._quant = FusedMoEQuantConfig("int4", layer.w13_scales, layer.w2_scales, w13_zeros=layer.w13_zeros,
                                              w2_zeros=layer.w2_zeros, w13_g_idx=layer.w13_g_idx,
                                              w2_g_idx=layer.w2_g_idx)
        return self._quant

    def dequantize_expert(self, layer: torch.nn.Module, p: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's projection `p` ("w13_" | "w2_") as a dense [out, in] tensor."""
        q = int4_math.unpack_rows(getattr(layer, p + "qweight")[e])
        zeros, scales, g_idx = (getattr(layer, p + n)[e] for n in ("zeros", "scales", "g_idx"))
        return int4_math.dequantize_int4(q, zeros, scales, g_idx, dtype).T

    def apply(
        self,
        layer: torch.nn.Module,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
        topk_ids: torch.Tensor,  # [num_tokens, top_k]
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]
        fused_experts: object,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        dtype = hidden.dtype
        return apply_experts(layer, layer.w13_qweight, layer.w2_qweight, self.get_fused_moe_quant_config(layer),
                             hidden, topk_weights, topk_ids, residual, fused_experts,
                             lambda e: (self.dequantize_expert(layer, "w13_", e, dtype),
                                        self.dequantize_expert(layer, "w2_", e, dtype)))
