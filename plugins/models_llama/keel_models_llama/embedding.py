"""Embedding models: the Llama-family decoder without its LM head (`LlamaModel`, `Qwen2Model`,
`Qwen3Model` checkpoints, e.g. Qwen3-Embedding), pooled over the prompt's final hidden states.

The pooling follows a sentence-transformers `1_Pooling/config.json` beside the checkpoint when there is
one (last token, mean or CLS; any other mode is refused by name), else the last token, as vLLM does for
decoder embedding models.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import ClassVar

import torch

from keel.models.interface import ModelBuildContext
from keel.models.weights import load_mapped_weights
from keel_models_llama.llama import LlamaForCausalLM
from keel_models_llama.qwen3 import Qwen3ForCausalLM

# sentence-transformers pooling flag -> our pooling type
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def pooling_type(model_dir: str) -> str:
    """The checkpoint's pooling ("last" without a sentence-transformers pooling config)."""
    path = Path(model_dir) / "1_Pooling" / "config.json"
    if not model_dir or not path.is_file():
        return "last"
    config = json.loads(path.read_text(encoding="utf-8"))
    on = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v)
    if len(on) != 1 or on[0] not in _MODES:
        raise ValueError(f"{path}: pooling {on} is not served (keel pools by last token, mean or CLS)")
    return _MODES[on[0]]


class LlamaEmbeddingModel(LlamaForCausalLM):
    """Capability "pooling"; it has no LM head, so it serves pooling requests only."""

    supports_pipeline_parallel: ClassVar[bool] = False  # the pooler needs the last stage's every row

    def __init__(self, build: ModelBuildContext) -> None:
        config = build.hf_config
        config.tie_word_embeddings = False  # no LM head at all
        super().__init__(build)
        del self.lm_head
        self.pooling_type = pooling_type(getattr(config, "_name_or_path", "") or "")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an embedding model has no LM head: it serves pooling requests only")

    def pool(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    ) -> torch.Tensor:  # [num_reqs, hidden_size]
        starts = query_start_loc.tolist()
        rows = []
        for a, b in itertools.pairwise(starts):
            if self.pooling_type == "mean":
                rows.append(hidden[a:b].float().mean(dim=0))
            else:
                rows.append(hidden[b - 1 if self.pooling_type == "last" else a].float())
        return torch.stack(rows)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # A base-model checkpoint names its tensors without the `model.` prefix of a causal LM's.
        named = ((name if name.startswith("model.") else f"model.{name}", t) for name, t in weights)
        return load_mapped_weights(self, named, self.stacked_params_mapping, self.skip_substrs)


class Qwen3EmbeddingModel(LlamaEmbeddingModel):
    variant = Qwen3ForCausalLM.variant  # type: ignore[assignment]
