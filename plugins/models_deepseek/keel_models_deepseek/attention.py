"""DeepSeek's multi-head latent attention block: projections, DeepSeek rope, and the MLA layer.

Checkpoint names (HF layout): `q_proj` (no q_lora_rank) or `q_a_proj` + `q_a_layernorm` + `q_b_proj`;
`kv_a_proj_with_mqa` (hidden -> kv_lora_rank + rope dims), `kv_a_layernorm`, `kv_b_proj` (latent ->
per-head nope key and value), `o_proj`.

Without quantization, the two projections of the hidden state -- `q_proj` (or `q_a_proj`) and
`kv_a_proj_with_mqa` -- run as one GEMM, `fused_qkv_a_proj` (vLLM's name), where both are whole on every
rank (`fuse_qkv_a`): one launch fewer per layer.

Rope layout: DeepSeek checkpoints rotate interleaved pairs (x0, x1), (x2, x3), ... (HF V2 always, V3
when `rope_interleave`). The MLA layer de-interleaves and rotates q's rope part and k_pe itself (see
`keel.layers.mla_attention`); this module hands it the raw projections.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from keel.forward_context import ForwardContext
from keel.layers.layernorm import RMSNorm
from keel.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from keel.layers.mla_attention import MLAAttention
from keel.layers.rotary import get_rope, get_rope_parameters
from keel.models.interface import ModelBuildContext
from keel.quantization import dense_weight


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(config: Any, rope: dict[str, Any]) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 for scaled rope (DeepSeek YaRN)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    if rope.get("rope_type", "default") != "default":
        mscale_all_dim = rope.get("mscale_all_dim") or 0
        if mscale_all_dim:
            factor = rope.get("factor") or config.max_position_embeddings / rope["original_max_position_embeddings"]
            m = yarn_get_mscale(factor, mscale_all_dim)
            scale = scale * m * m
    return scale


def fuse_qkv_a(config: Any, build: ModelBuildContext) -> bool:
    """Whether the q (or q_a) and kv_a projections are one GEMM (`fused_qkv_a_proj`), decided once per build
    (the model logs it and maps the checkpoint names). Both must be whole on every rank and alike in bias:
    q_a and kv_a are replicated and both carry `attention_bias`; q_proj (no q_lora_rank) is whole only at
    tp_size 1 and never has a bias (HF), so it fuses only without `attention_bias`. Unquantized only: a
    quantized checkpoint may treat the two differently (GPTQ's g_idx per module, ignore lists), so they stay
    two layers there. Why: at decode sizes these GEMMs are a few MB each and launch-bound (DeepSeek-V2-Lite
    at batch 1 on the H200: ~6 us per small GEMM); one launch per layer fewer is ~0.1 ms of a 27-layer
    batch-1 step."""
    if build.quant_method is not None:
        return False
    if getattr(config, "q_lora_rank", None):
        return True
    return build.tp_size == 1 and not getattr(config, "attention_bias", False)


class DeepseekV2MLAAttention(nn.Module):
    """Built by the decoder layer; `forward(positions, hidden, ctx)` every step."""

    def __init__(self, config: Any, layer_idx: int, build: ModelBuildContext, prefix: str) -> None:
        super().__init__()
        tp_size, tp_rank = build.tp_size, build.tp_rank
        total_heads = config.num_attention_heads
        if total_heads % tp_size:
            raise ValueError(f"num_attention_heads ({total_heads}) is not divisible by tensor parallel size {tp_size}")
        # Heads are split across TP ranks; the latent (kv_a) path is shared by all heads, so every rank
        # computes and caches the whole latent.
        self.num_heads = h = total_heads // tp_size
        self.qk_nope_head_dim = n = config.qk_nope_head_dim
        self.qk_rope_head_dim = r = config.qk_rope_head_dim
        self.v_head_dim = v = config.v_head_dim
        self.kv_lora_rank = lora = config.kv_lora_rank
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        hidden = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        quant = build.quant_method
        q_out = self.q_lora_rank or total_heads * (n + r)  # the first projection of the hidden state
        self.fused_qkv_a_proj = None
        if fuse_qkv_a(config, build):  # [q (or q_a); kv_a] in one weight, whole on every rank
            self.fused_qkv_a_proj = MergedColumnParallelLinear(hidden, [q_out, lora + r], bias,
                                                               prefix=f"{prefix}.fused_qkv_a_proj")
        if self.q_lora_rank:
            if self.fused_qkv_a_proj is None:
                self.q_a_proj = ReplicatedLinear(
                    hidden, self.q_lora_rank, bias, quant_config=quant, prefix=f"{prefix}.q_a_proj"
                )
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, total_heads * (n + r), False, tp_size, tp_rank, quant_config=quant,
                prefix=f"{prefix}.q_b_proj",
            )
            self.q_b_proj.set_input_producer(self.q_a_layernorm)
        elif self.fused_qkv_a_proj is None:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * (n + r), False, tp_size, tp_rank,
                                               quant_config=quant, prefix=f"{prefix}.q_proj")
        if self.fused_qkv_a_proj is None:
            self.kv_a_proj_with_mqa = ReplicatedLinear(
                hidden, lora + r, bias, quant_config=quant, prefix=f"{prefix}.kv_a_proj_with_mqa"
            )
        self.q_out = q_out
        self.kv_a_layernorm = RMSNorm(lora, config.rms_norm_eps)
        # MLA reads this weight directly as W_UK / W_UV (dequantized once if the checkpoint quantized it).
        self.kv_b_proj = ColumnParallelLinear(lora, total_heads * (n + v), False, tp_size, tp_rank,
                                              quant_config=quant, prefix=f"{prefix}.kv_b_proj")
        self.o_proj = RowParallelLinear(total_heads * v, hidden, bias, tp_size, tp_rank, quant_config=quant,
                                        prefix=f"{prefix}.o_proj")
        rope = get_rope_parameters(config)
        self.mla_attn = MLAAttention(layer_idx, h, n, r, v, lora, mla_softmax_scale(config, rope), build,
                                     get_rope(r, config.max_position_embeddings, rope),
                                     rope_interleaved=bool(getattr(config, "rope_interleave", True)))

    def input_projections(self) -> list[nn.Module]:
        """The layers that read the hidden state `forward` takes (the decoder layer declares its norm their
        producer)."""
        if self.fused_qkv_a_proj is not None:
            return [self.fused_qkv_a_proj]
        return [self.q_a_proj if self.q_lora_rank else self.q_proj, self.kv_a_proj_with_mqa]

    def process_weights_after_loading(self) -> None:
        """Called by the model after loading: W_UK / W_UV go to the MLA backend."""
        self.mla_attn.process_weights_after_loading(dense_weight(self.kv_b_proj))

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        lora, r = self.kv_lora_rank, self.qk_rope_head_dim
        if self.fused_qkv_a_proj is not None:  # views of one [tokens, q_out + L + R] output
            q, kv_c, k_pe = self.fused_qkv_a_proj(hidden).split([self.q_out, lora, r], dim=-1)
        else:
            q = self.q_a_proj(hidden) if self.q_lora_rank else self.q_proj(hidden)
            kv_c, k_pe = self.kv_a_proj_with_mqa(hidden).split([lora, r], dim=-1)
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q))
        # kv_a_layernorm and rope run inside the MLA layer (beside the query's W_UK fold where it can)
        out = self.mla_attn(positions, q, kv_c, k_pe, ctx, kv_norm=self.kv_a_layernorm)
        return self.o_proj(out)
