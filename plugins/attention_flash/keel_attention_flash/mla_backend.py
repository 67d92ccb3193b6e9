"""TritonMLABackend (`triton_mla`): multi-head latent attention (DeepSeek-V2/V3) written in Triton.

Serves `MLAAttention` layers; the forward contract is defined in `keel.layers.mla_attention`. The cache
holds one latent cat(kv_c, k_pe) per token, [num_blocks, block_size, kv_lora_rank + rope_dim]. Decode
runs split-K over the latents (flash-decoding), prefill runs causal query tiles of the same absorbed
kernel; fp32 (IEEE dot products), fp16, bf16. On CUDA the kernels are compiled; on the CPU they run only
through Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI checks them without a GPU.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from keel.attention.backend import (
    MLA_EXTRA_KEYS,
    AttentionLayerConfig,
    BackendCapabilities,
    BackendRequest,
    default_validate,
    latent_kv_cache_shape,
    mla_layer_reasons,
)
from keel.kv_cache.spec import KVCacheSpec
from keel_attention_flash.backend import UnsupportedLayerError, device_reasons
from keel_attention_flash.metadata import MAX_UNIFORM_QUERY_LEN
from keel_attention_flash.mla_impl import TritonMLAImpl
from keel_attention_flash.mla_metadata import TritonMLAMetadataBuilder


class TritonMLABackend:
    """Registered under `attention_backend` as `triton_mla` by the `attention-flash` plugin.

    `supports_cuda_graph`: a pure-decode step's metadata only references the common metadata's device
    tensors, its launch grid depends only on the batch size, and the kernels read each request's
    context length from `seq_lens` at run time, so the model runner may capture decode steps.
    `cuda_graph_max_query_len`: the same holds for uniform steps of up to that many new tokens per
    request (speculative verification), which run the split-K kernels with q query rows per request.
    """

    name: ClassVar[str] = "triton_mla"
    supports_cuda_graph: ClassVar[bool] = True
    cuda_graph_max_query_len: ClassVar[int] = MAX_UNIFORM_QUERY_LEN
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        block_sizes=(4, 8, 16, 32, 64, 128),
        device_types=("cuda", "cpu"),
        kv_cache_kinds=("mla_latent",),
        supports_mla=True,
        kv_cache_dtypes=(torch.float8_e4m3fn,),
    )

    @classmethod
    def validate(cls, request: BackendRequest) -> list[str]:
        """Called by the selector at startup: MLA layers only, their dimensions in `extra`, and on the
        CPU only under Triton's interpreter."""
        reasons = default_validate(cls.capabilities, request) + device_reasons(request.device_type)
        layer = request.layer
        if not layer.use_mla:
            reasons.append("triton_mla serves only MLA layers (use_mla=True)")
            return reasons
        reasons += mla_layer_reasons(layer)
        extra = dict(layer.extra)
        if all(k in extra for k in MLA_EXTRA_KEYS) and any(extra[k] <= 0 for k in MLA_EXTRA_KEYS):
            reasons.append(f"MLA dimensions must be positive, got { {k: extra[k] for k in MLA_EXTRA_KEYS} }")
        return reasons

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, spec: KVCacheSpec) -> tuple[int, ...]:
        """Called by the runner per layer: (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)."""
        return latent_kv_cache_shape("triton_mla", num_blocks, spec)

    @classmethod
    def get_metadata_builder(cls, device: torch.device) -> TritonMLAMetadataBuilder:
        """Called by the runner once per KV cache group."""
        return TritonMLAMetadataBuilder(device)

    @classmethod
    def get_impl(cls, layer: AttentionLayerConfig) -> TritonMLAImpl:
        """Called once per MLA layer when the model is built."""
        # The device was checked by the selector; here only the layer's own shape matters.
        reasons = cls.validate(BackendRequest(layer=layer, device_type="cuda", kv_cache_kind="mla_latent"))
        if reasons:
            raise UnsupportedLayerError(f"triton_mla cannot serve layer {layer}: " + "; ".join(reasons))
        return TritonMLAImpl(layer)
