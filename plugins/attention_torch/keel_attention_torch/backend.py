"""TorchPagedAttentionBackend (`torch_paged`): the reference paged-attention backend, plain torch.

keel's default backend on the CPU and the fallback everywhere else: any device type, fp32/fp16/bf16,
any head size and block size, GQA/MQA, sliding window. Causal decoder attention only.
"""

from __future__ import annotations

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
from keel_attention_torch.impl import TorchPagedAttentionImpl
from keel_attention_torch.metadata import TorchPagedMetadataBuilder


class TorchPagedAttentionBackend:
    """Registered under `attention_backend` as `torch_paged` by the `attention-torch` plugin."""

    name: ClassVar[str] = "torch_paged"
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        head_sizes=None,
        block_sizes=None,
        device_types=None,
        kv_cache_kinds=("full_attention", "sliding_window"),
        supports_mla=False,
        supports_sliding_window=True,
        supports_encoder=False,
        kv_cache_dtypes=(torch.float8_e4m3fn,),
        supports_soft_cap=False,
    )

    @classmethod
    def validate(cls, request: BackendRequest) -> list[str]:
        """Called by the selector at startup: the capability and layer-shape checks of the core."""
        return default_validate(cls.capabilities, request)

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, spec: KVCacheSpec) -> tuple[int, ...]:
        """Called by the runner per layer: (2, num_blocks, block_size, num_kv_heads, head_size)."""
        return per_head_kv_cache_shape("torch_paged", num_blocks, spec)

    @classmethod
    def get_metadata_builder(cls, device: torch.device) -> TorchPagedMetadataBuilder:
        """Called by the runner once per KV cache group."""
        return TorchPagedMetadataBuilder(device)

    @classmethod
    def get_impl(cls, layer: AttentionLayerConfig) -> TorchPagedAttentionImpl:
        """Called once per attention layer when the model is built."""
        reasons = cls.validate(BackendRequest(layer=layer, device_type="cpu", kv_cache_kind=_kind_of(layer)))
        if reasons:
            raise UnsupportedLayerError(f"torch_paged cannot serve layer {layer}: " + "; ".join(reasons))
        return TorchPagedAttentionImpl(layer)


def _kind_of(layer: AttentionLayerConfig) -> str:
    return "sliding_window" if layer.sliding_window is not None else "full_attention"
