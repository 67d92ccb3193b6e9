"""DeepSeek-V2 decoder: MLA attention, dense first layers, then MoE layers with shared experts.

Parameter names match HF checkpoints except for the stacked ones: dense `gate_proj`/`up_proj` ->
`gate_up_proj`, and per-expert `experts.{e}.{gate,up,down}_proj` -> `experts.w13_weight` / `w2_weight`
(shard id = (expert id, "w1" | "w3" | "w2")); with fused shared experts (`moe.shared_experts_fusion`)
`shared_experts.{gate,up,down}_proj` go into the same stacked parameters. Checkpoint layers at index >= num_hidden_layers are
DeepSeek-V3's multi-token-prediction modules; they are skipped here (MTP is served separately).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from keel.forward_context import ForwardContext
from keel.layers.decoder import DecoderStack, PreNormDecoderLayer
from keel.layers.fused_moe import FusedMoE
from keel.layers.layernorm import RMSNorm
from keel.layers.mla_attention import MLAAttention
from keel.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding, compute_logits
from keel.models.interface import ModelBuildContext
from keel.models.weights import load_mapped_weights
from keel_models_deepseek.attention import DeepseekV2MLAAttention, fuse_qkv_a
from keel_models_deepseek.moe import (
    DeepseekV2MLP,
    DeepseekV2MoE,
    log_shared_experts_fusion,
    shared_experts_fusion,
)

logger = logging.getLogger("keel.models.deepseek")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class UnsupportedDeepseekConfigError(ValueError):
    """The DeepSeek config asks for something keel does not serve yet."""


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    """DeepSeek's rule: routed experts from `first_k_dense_replace` on, every `moe_layer_freq` layers."""
    if not getattr(config, "n_routed_experts", None):
        return False
    first_dense = getattr(config, "first_k_dense_replace", 0) or 0
    freq = getattr(config, "moe_layer_freq", 1) or 1
    return layer_idx >= first_dense and layer_idx % freq == 0


class DeepseekV2DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: Any, layer_idx: int, build: ModelBuildContext, version: int, prefix: str) -> None:
        super().__init__()
        self.self_attn = DeepseekV2MLAAttention(config, layer_idx, build, f"{prefix}.self_attn")
        if is_moe_layer(config, layer_idx):
            self.mlp: nn.Module = DeepseekV2MoE(config, build, version, f"{prefix}.mlp")
        else:
            act = getattr(config, "hidden_act", "silu")
            self.mlp = DeepseekV2MLP(config.hidden_size, config.intermediate_size, act, build, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if isinstance(self.mlp, DeepseekV2MLP):  # a MoE reads its input for the router and the experts
            self.mlp.gate_up_proj.set_input_producer(self.post_attention_layernorm)
        for proj in self.self_attn.input_projections():  # q (or q_a) and kv_a share the quantized input
            proj.set_input_producer(self.input_layernorm)


class DeepseekV2Model(DecoderStack):
    def __init__(self, build: ModelBuildContext, version: int) -> None:
        super().__init__()
        config = build.hf_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, build.tp_size,
                                                   build.tp_rank)
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(config, i, build, version, f"model.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV2ForCausalLM(nn.Module):
    """Text generation for `DeepseekV2ForCausalLM` checkpoints; base of `DeepseekV3ForCausalLM`.

    Built by the model loader under the build's device/dtype; see `keel.models.interface.CausalLM`.
    Its attention layers are `MLAAttention` (KV cache kind "mla_latent").
    """

    version: ClassVar[int] = 2
    # MLA heads, dense MLPs and shared experts split over TP; routed experts split (TP) or sharded (EP).
    supports_tensor_parallel: ClassVar[bool] = True
    # Capability "quantization": fused parameter -> the checkpoint modules it packs.
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"gate_up_proj": ["gate_proj", "up_proj"]}
    skip_substrs: ClassVar[tuple[str, ...]] = (
        "rotary_emb.inv_freq",
        "rotary_emb.cos_cached",
        "rotary_emb.sin_cached",
    )

    def __init__(self, build: ModelBuildContext) -> None:
        super().__init__()
        self.config = config = build.hf_config
        self.shared_experts_fusion = shared_experts_fusion(config, build)
        log_shared_experts_fusion(self.shared_experts_fusion)
        self.fused_qkv_a = fuse_qkv_a(config, build)  # every attention layer (MTP's too) decides alike
        logger.info("DeepSeek MLA: %s", "q and kv_a projections fused (fused_qkv_a_proj)" if self.fused_qkv_a
                    else "q and kv_a projections separate (quantized, or q_proj split over tensor parallel)")
        self.model = DeepseekV2Model(build, self.version)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head: VocabParallelEmbedding = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, build.tp_size, build.tp_rank)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        return compute_logits(self.lm_head, hidden)

    def attention_layers(self) -> list[MLAAttention]:
        """The attention layers in layer-index order (the runner asks each for its kv_cache_spec)."""
        return [layer.self_attn.mla_attn for layer in self.model.layers]

    def moe_layers(self) -> list[FusedMoE]:
        """The routed-expert layers (capability: MoE)."""
        return [layer.mlp.experts for layer in self.model.layers if isinstance(layer.mlp, DeepseekV2MoE)]

    @classmethod
    def get_expert_mapping(cls, hf_config: Any) -> list[tuple[str, str, int, str]]:
        """Capability MoE: (param fragment, checkpoint fragment, expert id, shard id) per expert tensor."""
        rows = FusedMoE.make_expert_params_mapping(getattr(hf_config, "n_routed_experts", None) or 0)
        return [(param, ckpt, expert, shard) for param, ckpt, (expert, shard) in rows]

    def stacked_params_mapping(self) -> list[tuple[str, str, Any]]:
        # Expert rows first: the dense ".gate_proj" row would otherwise claim expert tensors too.
        shared = FusedMoE.make_shared_expert_params_mapping() if self.shared_experts_fusion.num_fused else []
        q_first = ".q_a_proj" if getattr(self.config, "q_lora_rank", None) else ".q_proj"
        qkv_a = [(".fused_qkv_a_proj", q_first, 0), (".fused_qkv_a_proj", ".kv_a_proj_with_mqa", 1)]
        return [
            *FusedMoE.make_expert_params_mapping(self.config.n_routed_experts or 0),
            *shared,
            *(qkv_a if self.fused_qkv_a else []),
            (".gate_up_proj", ".gate_proj", 0),
            (".gate_up_proj", ".up_proj", 1),
        ]

    def _is_extra_layer(self, name: str) -> bool:
        m = _LAYER_RE.match(name)
        return m is not None and int(m.group(1)) >= self.config.num_hidden_layers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = self.skip_substrs + (("lm_head.weight",) if self.tie_word_embeddings else ())
        ours = ((name, t) for name, t in weights if not self._is_extra_layer(name))
        return load_mapped_weights(self, ours, self.stacked_params_mapping(), skip)

    def process_weights_after_loading(self) -> None:
        """Called by the model loader after the weights are in (checkpoint or dummy): MLA absorbs
        kv_b_proj into W_UK / W_UV. Call it again after replacing weights by hand."""
        for layer in self.model.layers:
            layer.self_attn.process_weights_after_loading()
