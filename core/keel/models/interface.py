"""What a model class registered under the `model_arch` kind looks like to the core.

The model runner builds the model with a `ModelBuildContext`, loads weights through
`load_weights`, then calls `forward` and `compute_logits` every step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from keel.forward_context import ForwardContext


@dataclass(frozen=True)
class ModelBuildContext:
    """Everything a model needs at construction. Frozen: fields are only ever added."""

    hf_config: Any  # transformers.PretrainedConfig
    dtype: torch.dtype
    device: torch.device
    block_size: int
    attention_backend: Any  # the selected AttentionBackend class
    quant_method: Any = None  # a QuantizationConfig (or one QuantizationMethod for every layer); None: unquantized
    mla_backend: Any = None  # the selected MLA backend class, for models with MLA layers
    # (layer config, KV cache spec kind) -> backend class. Set by the worker so each distinct kind of
    # layer (standard, sliding window, MLA) gets a validated backend; None in unit tests.
    attention_selector: Callable[[Any, str], Any] | None = None
    # This rank's place in the tensor-parallel group; layers shard themselves with these. Collectives
    # go through `keel.distributed.get_tp_group()`, created by the worker before the model is built.
    tp_size: int = 1
    tp_rank: int = 0
    enable_expert_parallel: bool = False  # MoE experts sharded over the TP x DP ranks instead of split
    # This rank's data-parallel replica; with expert parallelism a MoE layer gathers the DP ranks' tokens.
    dp_size: int = 1
    dp_rank: int = 0
    # This rank's pipeline stage; a model declaring `supports_pipeline_parallel` builds only its layers.
    pp_size: int = 1
    pp_rank: int = 0
    kv_cache_dtype: torch.dtype | None = None  # the KV cache's storage dtype; None: the model dtype
    # MoE models: keep shared experts as their own MLP (`ModelConfig.disable_shared_experts_fusion`)
    disable_shared_experts_fusion: bool = False

    def backend_for(self, layer: Any, kv_cache_kind: str) -> Any:
        """Called by attention layers at construction: the backend class that will serve them."""
        if self.attention_selector is not None:
            return self.attention_selector(layer, kv_cache_kind)
        if getattr(layer, "use_mla", False) and self.mla_backend is not None:
            return self.mla_backend
        return self.attention_backend


@runtime_checkable
class CausalLM(Protocol):
    """Capability: text generation. Checked structurally by the model registry."""

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        ctx: ForwardContext,
    ) -> torch.Tensor:  # hidden states [num_tokens, hidden_size]
        """Called by the model runner every step with the flattened, unpadded batch."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size], only at sampling positions: in float32 or in the
        model's dtype (the sampler upcasts where it needs float32; an argmax does not)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume (checkpoint name, tensor) pairs; return the names of parameters loaded.

        Called once by the model loader. Raises `WeightLoadError` for an unconsumed checkpoint tensor
        or a shape mismatch; the loader raises for parameters never loaded.
        """
        ...
