"""Model capabilities, checked structurally on the model *class* (never by building the model).

The model registry's `inspect_model_cls` reports which of these a registered class satisfies, so the
engine can refuse a task (pooling on a generation-only model, MTP speculation without MTP layers,
tensor parallelism on a model that does not shard) before any weight is loaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from keel.forward_context import ForwardContext
from keel.models.interface import CausalLM

SupportsTextGeneration = CausalLM


@runtime_checkable
class SupportsPooling(Protocol):
    def pool(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    ) -> torch.Tensor:  # [num_reqs, pooled_size]
        """Called by the model runner for pooling (embedding) requests after `forward`."""
        ...


@runtime_checkable
class SupportsMoE(Protocol):
    @classmethod
    def get_expert_mapping(cls, hf_config: Any) -> list[tuple[str, str, int, str]]:
        """Called by the weight loader: (param name, checkpoint name, expert id, shard id) rows used
        to stack per-expert checkpoint tensors into fused expert parameters."""
        ...


@runtime_checkable
class SupportsMTP(Protocol):
    def forward_mtp(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64: the tokens shifted by one (last = sampled)
        positions: torch.Tensor,  # [num_tokens] int64
        hidden: torch.Tensor,  # [num_tokens, hidden_size]: the main model's hidden states
        ctx: ForwardContext,
        step: int = 0,  # which MTP module (0 for the first speculative token)
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """Called by the speculative proposer once per draft token; writes tentative KV only."""
        ...


@runtime_checkable
class SupportsTensorParallel(Protocol):
    # Declared by a model whose layers shard themselves with ModelBuildContext's TP rank and size.
    supports_tensor_parallel: ClassVar[bool]


@runtime_checkable
class SupportsPipelineParallel(Protocol):
    # Declared by a model that builds only ModelBuildContext's pipeline stage and takes / returns
    # `keel.distributed.pipeline.IntermediateTensors` (forward's `intermediate_tensors` argument).
    supports_pipeline_parallel: ClassVar[bool]


@runtime_checkable
class SupportsQuantization(Protocol):
    # Fused parameter -> the checkpoint modules it packs (e.g. "qkv_proj": ["q_proj", "k_proj",
    # "v_proj"]), so a QuantizationConfig can map per-module settings onto fused layers.
    packed_modules_mapping: ClassVar[dict[str, list[str]]]


CAPABILITIES: dict[str, type] = {
    "text_generation": SupportsTextGeneration,
    "pooling": SupportsPooling,
    "moe": SupportsMoE,
    "mtp": SupportsMTP,
    "tensor_parallel": SupportsTensorParallel,
    "pipeline_parallel": SupportsPipelineParallel,
    "quantization": SupportsQuantization,
}


def _members(proto: type) -> Iterable[str]:
    skip = {"__init__", "__subclasshook__", "__abstractmethods__", "__non_callable_proto_members__"}
    names = set(getattr(proto, "__annotations__", {}))
    names |= {n for n in vars(proto) if not n.startswith("_")}
    return sorted(n for n in names if n not in skip and not n.startswith("_"))


def supports(model_cls: type, capability: str) -> bool:
    """Whether `model_cls` has every member of `capability` (a flag attribute must be truthy)."""
    proto = CAPABILITIES[capability]
    for name in _members(proto):
        if not hasattr(model_cls, name):
            return False
        if name.startswith("supports_") and not getattr(model_cls, name):
            return False
    return True


def model_capabilities(model_cls: type) -> frozenset[str]:
    return frozenset(c for c in CAPABILITIES if supports(model_cls, c))
