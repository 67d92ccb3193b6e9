"""What a model's forward pass needs besides token ids and positions, handed down explicitly.

No module-level mutable state: the runner builds one `ForwardContext` per step and passes it to
`model.forward`, which passes it to every attention layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ForwardContext:
    attn_metadata: Sequence[Any]  # per attention layer index: the backend metadata for its cache group
    kv_caches: Sequence[torch.Tensor]  # per attention layer index
    num_actual_tokens: int = 0
    # Every data-parallel rank's token count this step (`SchedulerOutput.dp_num_tokens`): a MoE layer
    # gathering tokens across DP ranks pads to the largest. Empty: one DP rank, or a dummy forward in
    # which every rank runs the same shapes (profiling).
    dp_num_tokens: tuple[int, ...] = ()

    @classmethod
    def empty(cls) -> ForwardContext:
        """For a dummy forward (memory profiling) before any cache exists."""
        return cls(attn_metadata=(), kv_caches=())
