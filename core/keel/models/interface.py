"""What a model class registered under the `model_arch` kind looks like to the core.

The model runner builds the model with a `ModelBuildContext`, loads weights through
`load_weights`, then calls `forward` and `compute_logits` every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol, runtime_checkable

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
    quant_method: Any = None  # a QuantizationMethod, or None for unquantized
    mla_backend: Any = None  # the selected MLA backend class, for models with MLA layers


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
        """hidden [n, hidden_size] -> logits [n, vocab_size] in float32, only at sampling positions."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume (checkpoint name, tensor) pairs; return the names of parameters loaded.

        Called once by the model loader. Raises `WeightLoadError` for an unconsumed checkpoint tensor
        or a shape mismatch; the loader raises for parameters never loaded.
        """
        ...
