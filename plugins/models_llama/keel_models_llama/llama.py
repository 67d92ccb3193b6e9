"""Llama-family decoder (Llama 2/3/3.1, and through small subclasses Mistral, Qwen2, Qwen3).

The architecture differences are data, not code paths: a `LlamaVariant` says which projections have
biases and whether q/k get a per-head RMSNorm; `layer_sliding_window` reads which layers use a
sliding window. Parameter names match HF checkpoints except for the stacked projections listed in
`stacked_params_mapping`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from keel.forward_context import ForwardContext
from keel.layers.activation import get_act_and_mul_fn
from keel.layers.attention import Attention
from keel.distributed.pipeline import IntermediateTensors, get_pp_indices
from keel.layers.decoder import DecoderStack, PPMissingLayer, PreNormDecoderLayer
from keel.layers.layernorm import RMSNorm
from keel.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from keel.layers.rotary import get_rope, get_rope_parameters
from keel.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding, compute_logits
from keel.models.interface import ModelBuildContext
from keel.models.weights import load_mapped_weights


@dataclass(frozen=True)
class LlamaVariant:
    """Per-architecture switches, derived from the HF config by `LlamaForCausalLM.variant`."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope


def _tp(build: ModelBuildContext) -> tuple[int, int]:
    return build.tp_size, build.tp_rank


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """The sliding window (tokens visible, including the query itself) of layer `layer_idx`, or None.

    transformers 5.x lists `layer_types`; older Qwen2 configs use `use_sliding_window` with
    `max_window_layers` (layers below it attend fully); Mistral applies `sliding_window` everywhere.
    """
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    max_window_layers = getattr(config, "max_window_layers", None)
    if max_window_layers is not None and layer_idx < max_window_layers:
        return None
    return window


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, build: ModelBuildContext, bias: bool, prefix: str) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        tp_size, tp_rank = _tp(build)
        quant = build.quant_method
        self.gate_up_proj = MergedColumnParallelLinear(
            h, [i, i], bias, tp_size, tp_rank, quant_config=quant, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            i, h, bias, tp_size, tp_rank, quant_config=quant, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = get_act_and_mul_fn(getattr(config, "hidden_act", "silu"))
        self.down_proj.set_input_source(self.gate_up_proj, parts=2)  # act(gate) * up, per index
        self.down_proj.set_input_producer(self.act_fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden_size]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, build: ModelBuildContext, variant: LlamaVariant, prefix: str,
        kv_index: int | None = None,
    ) -> None:
        """`kv_index`: the layer's index among this stage's attention layers (default `layer_idx`)."""
        super().__init__()
        tp_size, tp_rank = _tp(build)
        self.head_dim = head_dim_of(config)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            num_kv_heads,
            variant.qkv_bias,
            tp_size,
            tp_rank,
            quant_config=build.quant_method,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            variant.o_bias,
            tp_size,
            tp_rank,
            quant_config=build.quant_method,
            prefix=f"{prefix}.o_proj",
        )
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps) if variant.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if variant.qk_norm else None
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, get_rope_parameters(config))
        self.attn = Attention(
            layer_idx if kv_index is None else kv_index,
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            build,
            sliding_window=layer_sliding_window(config, layer_idx),
        )

    def _head_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:  # x: [n, heads * head_dim]
        n = x.shape[0]
        return norm(x.view(n, -1, self.head_dim)).view(n, -1)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self._head_norm(self.q_norm, q), self._head_norm(self.k_norm, k)
        return self.o_proj(self.attn(q, k, v, ctx, rotary=self.rotary_emb, positions=positions))


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(
        self, config: Any, layer_idx: int, build: ModelBuildContext, variant: LlamaVariant, prefix: str,
        kv_index: int | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, build, variant, f"{prefix}.self_attn", kv_index)
        self.mlp = LlamaMLP(config, build, variant.mlp_bias, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn.qkv_proj.set_input_producer(self.input_layernorm)
        self.mlp.gate_up_proj.set_input_producer(self.post_attention_layernorm)


class LlamaModel(DecoderStack):
    def __init__(self, build: ModelBuildContext, variant: LlamaVariant) -> None:
        super().__init__()
        config = build.hf_config
        tp_size, tp_rank = _tp(build)
        first, last = build.pp_rank == 0, build.pp_rank == build.pp_size - 1
        tied = bool(getattr(config, "tie_word_embeddings", False))
        # The first stage embeds; with tied embeddings the last stage's LM head is the same weight.
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_size, tp_rank)
                             if first or (last and tied) else PPMissingLayer())
        start = get_pp_indices(config.num_hidden_layers, build.pp_rank, build.pp_size)[0]
        self.layers = self.make_layers(
            config.num_hidden_layers, build.pp_rank, build.pp_size,
            lambda i: LlamaDecoderLayer(config, i, build, variant, f"model.layers.{i}", kv_index=i - start),
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if last else PPMissingLayer()


class LlamaForCausalLM(nn.Module):
    """Text generation model for `LlamaForCausalLM` checkpoints; base of the Mistral/Qwen2/Qwen3 classes.

    Built by the model loader under the build's device/dtype; see `keel.models.interface.CausalLM`.
    """

    supports_tensor_parallel: ClassVar[bool] = True  # every layer shards itself by build.tp_rank
    supports_pipeline_parallel: ClassVar[bool] = True  # builds only build.pp_rank's layers
    # (stacked param fragment, checkpoint fragment, shard id)
    stacked_params_mapping: ClassVar[list[tuple[str, str, Any]]] = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]
    # Capability "quantization": fused parameter -> the checkpoint modules it packs.
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    # Checkpoint entries that are derived state, not weights.
    skip_substrs: ClassVar[tuple[str, ...]] = (
        "rotary_emb.inv_freq",
        "rotary_emb.cos_cached",
        "rotary_emb.sin_cached",
    )

    @classmethod
    def variant(cls, config: Any) -> LlamaVariant:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return LlamaVariant(
            qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=bool(getattr(config, "mlp_bias", False))
        )

    def __init__(self, build: ModelBuildContext) -> None:
        super().__init__()
        self.config = config = build.hf_config
        tp_size, tp_rank = _tp(build)
        self.model = LlamaModel(build, self.variant(config))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if build.pp_rank != build.pp_size - 1:
            self.lm_head: nn.Module = PPMissingLayer()
        elif self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_size, tp_rank)
        # Checkpoint names of modules another pipeline stage holds (their tensors are not ours to load).
        self._elsewhere = tuple(f"{name}." for name, m in self.named_modules() if isinstance(m, PPMissingLayer))

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        ctx: ForwardContext,
        intermediate_tensors: IntermediateTensors | None = None,  # from the previous pipeline stage
    ) -> torch.Tensor | IntermediateTensors:  # [num_tokens, hidden_size] (the next stage's inputs if any)
        return self.model(input_ids, positions, ctx, intermediate_tensors)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        return compute_logits(self.lm_head, hidden)

    def attention_layers(self) -> list[Attention]:
        """The attention layers in layer-index order (the runner asks each for its kv_cache_spec)."""
        return [layer.self_attn.attn for layer in self.model.local_layers()]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = self.skip_substrs + (("lm_head.weight",) if self.tie_word_embeddings else ())
        ours = ((name, t) for name, t in weights if not name.startswith(self._elsewhere))
        return load_mapped_weights(self, ours, self.stacked_params_mapping, skip)
