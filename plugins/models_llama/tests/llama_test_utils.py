"""Test-only helpers: a dense causal SDPA attention backend and a one-step prefill driver.

The real paged backends live in other plugins; these tests need only attention math, so the backend
here ignores the KV cache and attends within each request's new tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from keel.attention.backend import (
    AttentionLayerConfig,
    BackendCapabilities,
    BackendRequest,
    default_validate,
)
from keel.attention.metadata import CommonAttentionMetadata
from keel.forward_context import ForwardContext
from keel.kv_cache.spec import KVCacheSpec
from keel.models.interface import ModelBuildContext
from keel.models.loader import load_model


class _PassThroughBuilder:
    def build(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        return common


class DenseSDPAImpl:
    """Causal (optionally sliding-window) attention per request; K/V are not cached."""

    def __init__(self, layer: AttentionLayerConfig) -> None:
        self.layer = layer

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_size]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,
        metadata: CommonAttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        groups = self.layer.num_heads // self.layer.num_kv_heads
        out = torch.zeros_like(q)
        starts = metadata.query_start_loc_cpu.tolist()
        for s, e in itertools.pairwise(starts):
            qi = q[s:e].transpose(0, 1)
            ki = k[s:e].repeat_interleave(groups, dim=1).transpose(0, 1)
            vi = v[s:e].repeat_interleave(groups, dim=1).transpose(0, 1)
            idx = torch.arange(e - s)
            mask = idx[None, :] <= idx[:, None]
            if self.layer.sliding_window is not None:
                mask &= idx[None, :] > idx[:, None] - self.layer.sliding_window
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=self.layer.scale)
            out[s:e] = o.transpose(0, 1)
        return out


class DenseSDPABackend:
    name: ClassVar[str] = "test-dense-sdpa"
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        supports_sliding_window=True, kv_cache_kinds=("full_attention", "sliding_window")
    )

    @classmethod
    def validate(cls, request: BackendRequest) -> list[str]:
        return default_validate(cls.capabilities, request)

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, spec: KVCacheSpec) -> tuple[int, ...]:
        return (1,)

    @classmethod
    def get_metadata_builder(cls, device: torch.device) -> _PassThroughBuilder:
        return _PassThroughBuilder()

    @classmethod
    def get_impl(cls, layer: AttentionLayerConfig) -> DenseSDPAImpl:
        return DenseSDPAImpl(layer)


def build_context(path: Path, dtype: torch.dtype = torch.float32) -> ModelBuildContext:
    return ModelBuildContext(
        hf_config=AutoConfig.from_pretrained(path),
        dtype=dtype,
        device=torch.device("cpu"),
        block_size=16,
        attention_backend=DenseSDPABackend,
    )


def load_keel(model_cls: Any, path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return load_model(model_cls, build_context(path, dtype), path)


@torch.no_grad()
def prefill_logits(model: Any, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """All prompts as one flattened varlen batch; logits at every token [total_tokens, vocab]."""
    lens = [len(p) for p in prompts]
    input_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    meta = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens,
        block_table=torch.zeros(len(lens), 1, dtype=torch.int32),
        slot_mapping=torch.full((len(input_ids),), -1, dtype=torch.int64),
        num_reqs=len(lens),
        num_actual_tokens=len(input_ids),
        max_query_len=max(lens),
        max_seq_len=max(lens),
        block_size=16,
    )
    layers = model.attention_layers()
    ctx = ForwardContext(
        attn_metadata=[meta] * len(layers),
        kv_caches=[torch.zeros(1)] * len(layers),
        num_actual_tokens=len(input_ids),
    )
    hidden = model(input_ids, positions, ctx)
    return model.compute_logits(hidden).float()


@torch.no_grad()
def hf_logits(
    path: Path, prompts: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    return torch.cat([ref(torch.tensor([p])).logits[0].float() for p in prompts])


def random_prompts(vocab: int, lens: Sequence[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
