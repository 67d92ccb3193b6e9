"""TritonFlashAttentionBackend (`triton_flash`): paged FlashAttention written in Triton.

Varlen batches mixing prefill, chunked prefill and decode; causal; GQA/MQA; sliding window; head
sizes 64/128/256; block sizes 16..128; fp32 (IEEE dot products), fp16, bf16. On CUDA the kernels are
compiled; on the CPU they run only through Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI
checks them without a GPU.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch

from keel.attention.backend import (
    AttentionLayerConfig,
    BackendCapabilities,
    BackendRequest,
    UnsupportedLayerError,
    default_validate,
    per_head_kv_cache_shape,
)
from keel.kv_cache.spec import KVCacheSpec
from keel_attention_flash.impl import TritonFlashAttentionImpl
from keel_attention_flash.metadata import MAX_UNIFORM_QUERY_LEN, FlashMetadataBuilder


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def device_reasons(device_type: str) -> list[str]:
    """Why this plugin's Triton kernels cannot run on `device_type` (empty when they can); shared by the
    validate() of both backends."""
    if device_type == "cpu" and not interpreter_enabled():
        reason = ("on the CPU the Triton kernels need the interpreter: set TRITON_INTERPRET=1 "
                  "before starting (slow; meant for tests)")
        return [reason]
    return []


class TritonFlashAttentionBackend:
    """Registered under `attention_backend` as `triton_flash` by the `attention-flash` plugin.

    `supports_cuda_graph`: a pure-decode step's metadata only references the common metadata's device
    tensors and its launch grid depends only on the batch size, so the model runner may capture it.
    `cuda_graph_max_query_len`: the same holds for uniform steps of up to that many new tokens per
    request (speculative verification), which run the split-K kernels with q query rows per request.
    """

    name: ClassVar[str] = "triton_flash"
    supports_cuda_graph: ClassVar[bool] = True
    cuda_graph_max_query_len: ClassVar[int] = MAX_UNIFORM_QUERY_LEN
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        head_sizes=(64, 128, 256),
        block_sizes=(16, 32, 64, 128),
        device_types=("cuda", "cpu"),
        kv_cache_kinds=("full_attention", "sliding_window"),
        supports_mla=False,
        supports_sliding_window=True,
        supports_encoder=False,
        supports_soft_cap=False,
        kv_cache_dtypes=(torch.float8_e4m3fn,),
    )

    @classmethod
    def validate(cls, request: BackendRequest) -> list[str]:
        """Called by the selector at startup: capabilities, GQA divisibility, interpreter on the CPU."""
        # default_validate includes GQA divisibility and window > 0.
        return default_validate(cls.capabilities, request) + device_reasons(request.device_type)

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, spec: KVCacheSpec) -> tuple[int, ...]:
        """Called by the runner per layer: (2, num_blocks, block_size, num_kv_heads, head_size)."""
        return per_head_kv_cache_shape("triton_flash", num_blocks, spec)

    @classmethod
    def get_metadata_builder(cls, device: torch.device) -> FlashMetadataBuilder:
        """Called by the runner once per KV cache group."""
        return FlashMetadataBuilder(device)

    @classmethod
    def get_impl(cls, layer: AttentionLayerConfig) -> TritonFlashAttentionImpl:
        """Called once per attention layer when the model is built."""
        kind = "sliding_window" if layer.sliding_window is not None else "full_attention"
        # The device was checked by the selector; here only the layer's own shape matters.
        reasons = cls.validate(BackendRequest(layer=layer, device_type="cuda", kv_cache_kind=kind))
        if reasons:
            raise UnsupportedLayerError(f"triton_flash cannot serve layer {layer}: " + "; ".join(reasons))
        return TritonFlashAttentionImpl(layer)
