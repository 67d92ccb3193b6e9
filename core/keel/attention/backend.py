"""AttentionBackend: the protocol every attention implementation plugin satisfies.

A backend is registered under the `attention_backend` kind with an open string key. The core's
selector (attention/selector.py) asks each candidate -- in the platform's preference order, or the one
the profile names -- to `validate` a `BackendRequest` and logs every rejection reason.

Lifecycle (all calls come from the model runner, on the worker):
1. `validate(request)` at startup, once per distinct layer configuration.
2. `kv_cache_shape(num_blocks, spec)` when the runner allocates each layer's cache tensor.
3. `get_metadata_builder(...)` once; its `build(common)` once per step (per KV cache group).
4. `get_impl(layer)` once per attention layer when the model is built; its `forward` every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from keel.attention.metadata import CommonAttentionMetadata
from keel.kv_cache.spec import KVCacheSpec


@dataclass(frozen=True)
class AttentionLayerConfig:
    """One attention layer as the model declares it. Frozen: fields are only ever added.

    For MLA layers (`use_mla=True`) `head_size` is the query/key head size seen by the kernel and
    `extra` carries what the absorbed form needs (kv_lora_rank, qk_rope_head_dim, v_head_dim ...).
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    dtype: torch.dtype
    block_size: int
    causal: bool = True
    sliding_window: int | None = None
    use_mla: bool = False
    logits_soft_cap: float | None = None
    extra: tuple[tuple[str, Any], ...] = ()
    kv_cache_dtype: torch.dtype | None = None  # the cache's storage dtype when it differs from `dtype`

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype


@dataclass(frozen=True)
class BackendRequest:
    """What the selector asks a backend to support."""

    layer: AttentionLayerConfig
    device_type: str
    kv_cache_kind: str


@dataclass(frozen=True)
class BackendCapabilities:
    """Declared, checked by `default_validate`. None means "any"."""

    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
    head_sizes: tuple[int, ...] | None = None
    block_sizes: tuple[int, ...] | None = None
    device_types: tuple[str, ...] | None = None
    kv_cache_kinds: tuple[str, ...] = ("full_attention",)
    supports_mla: bool = False
    supports_sliding_window: bool = False
    supports_encoder: bool = False
    supports_soft_cap: bool = False
    extra: tuple[str, ...] = field(default=())
    kv_cache_dtypes: tuple[torch.dtype, ...] = ()  # cache storage dtypes besides the model dtype (fp8)


def default_validate(caps: BackendCapabilities, request: BackendRequest) -> list[str]:
    """Reasons a backend with capabilities `caps` cannot serve `request` (empty list: it can)."""
    layer = request.layer
    reasons = []
    if layer.dtype not in caps.dtypes:
        reasons.append(f"dtype {layer.dtype} not in {caps.dtypes}")
    if caps.head_sizes is not None and layer.head_size not in caps.head_sizes:
        reasons.append(f"head size {layer.head_size} not in {caps.head_sizes}")
    if caps.block_sizes is not None and layer.block_size not in caps.block_sizes:
        reasons.append(f"block size {layer.block_size} not in {caps.block_sizes}")
    if caps.device_types is not None and request.device_type not in caps.device_types:
        reasons.append(f"device type {request.device_type!r} not in {caps.device_types}")
    if request.kv_cache_kind not in caps.kv_cache_kinds:
        reasons.append(f"KV cache kind {request.kv_cache_kind!r} not in {caps.kv_cache_kinds}")
    if layer.use_mla and not caps.supports_mla:
        reasons.append("MLA not supported")
    if layer.sliding_window is not None and not caps.supports_sliding_window:
        reasons.append("sliding window not supported")
    if not layer.causal and not caps.supports_encoder:
        reasons.append("non-causal (encoder) attention not supported")
    if layer.cache_dtype != layer.dtype and layer.cache_dtype not in caps.kv_cache_dtypes:
        reasons.append(f"KV cache dtype {layer.cache_dtype} not supported (only the model dtype"
                       + (f" or {caps.kv_cache_dtypes})" if caps.kv_cache_dtypes else ")"))
    if layer.logits_soft_cap is not None and not caps.supports_soft_cap:
        reasons.append("logits soft cap not supported")
    # Shape facts every backend relies on, whatever it declares.
    if layer.num_kv_heads <= 0 or layer.num_heads % layer.num_kv_heads != 0:
        reasons.append(f"num_heads {layer.num_heads} is not a multiple of num_kv_heads {layer.num_kv_heads}")
    if layer.sliding_window is not None and layer.sliding_window <= 0:
        reasons.append(f"sliding window {layer.sliding_window} must be positive")
    return reasons


class UnsupportedLayerError(ValueError):
    """Raised by a backend's `get_impl` / `kv_cache_shape` for a layer or spec it cannot serve."""


def per_head_kv_cache_shape(backend: str, num_blocks: int, spec: KVCacheSpec) -> tuple[int, ...]:
    """The standard K/V layout (2, num_blocks, block_size, num_kv_heads, head_size) for `spec`; what
    per-head backends return from `kv_cache_shape`. Raises UnsupportedLayerError naming `backend` for a
    latent (MLA) spec."""
    from keel.kv_cache.spec import FullAttentionSpec

    if not isinstance(spec, FullAttentionSpec):
        raise UnsupportedLayerError(
            f"{backend} stores K/V per head; got a {type(spec).__name__} (kind {spec.kind!r}). "
            "Select an MLA-capable attention backend for this model."
        )
    return (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)


def latent_kv_cache_shape(backend: str, num_blocks: int, spec: KVCacheSpec) -> tuple[int, ...]:
    """The standard MLA layout (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim); what MLA
    backends return from `kv_cache_shape`. Raises UnsupportedLayerError naming `backend` otherwise."""
    from keel.kv_cache.spec import MLALatentSpec

    if not isinstance(spec, MLALatentSpec):
        raise UnsupportedLayerError(
            f"{backend} stores latents; got a {type(spec).__name__} (kind {spec.kind!r}). "
            "Select a standard attention backend for this model."
        )
    return (num_blocks, spec.block_size, spec.latent_size)


# What an MLA layer config carries in `extra` (the contract is documented in keel.layers.mla_attention).
MLA_EXTRA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def mla_layer_reasons(layer: AttentionLayerConfig) -> list[str]:
    """Why `layer` (use_mla=True) breaks the MLA layer-config contract; empty if it keeps it. Every MLA
    backend's `validate` calls it, so the contract is checked in one place."""
    extra = dict(layer.extra)
    missing = [k for k in MLA_EXTRA_KEYS if k not in extra]
    if missing:
        return [f"MLA layer config lacks {missing} in `extra`"]
    reasons = []
    if layer.num_kv_heads != 1:
        reasons.append(f"MLA layers have one shared latent head, got num_kv_heads={layer.num_kv_heads}")
    if layer.head_size != extra["kv_lora_rank"] + extra["qk_rope_head_dim"]:
        reasons.append(
            f"MLA head_size {layer.head_size} != kv_lora_rank + qk_rope_head_dim "
            f"({extra['kv_lora_rank']} + {extra['qk_rope_head_dim']})"
        )
    return reasons


@runtime_checkable
class AttentionMetadataBuilder(Protocol):
    def build(self, common: CommonAttentionMetadata) -> Any:
        """Called by the model runner once per step, before the forward pass.

        Returns the backend's own metadata object, handed unchanged to every layer's `forward` for
        this step. Must not synchronize with the device beyond what `common`'s CPU tensors allow.
        """
        ...


@runtime_checkable
class AttentionImpl(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_size]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]   (MLA: latent [num_tokens, kv_lora_rank])
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]   (MLA: rope key [num_tokens, rope_dim])
        kv_cache: torch.Tensor,  # shape from kv_cache_shape()
        metadata: Any,  # from the builder, this step
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size_v]
        """Called by the attention layer every step.

        Writes the new tokens' K/V into `kv_cache` at `slot_mapping`, then computes attention of each
        new token over its request's context (causal within the new tokens). Tokens at positions
        >= num_actual_tokens are padding: their output is unspecified but finite work is done.
        """
        ...


class AttentionBackend(Protocol):
    """A class (not an instance) registered under the `attention_backend` kind.

    Optional class attributes read by the model runner (absent means False / 1):
    `supports_cuda_graph: bool` -- a step where every request has one new token may be captured as a
    CUDA graph: the builder's metadata references only the common metadata's device tensors (the runner
    refills them in place before each replay), and launch shapes depend only on num_reqs and
    max_seq_len, never on actual lengths; no host syncs in `forward`.
    `cuda_graph_max_query_len: int` -- the same holds for uniform steps where every request has exactly
    q <= this many new tokens (speculative verify steps, q = 1 + drafts); launch shapes may depend on q.
    """

    name: ClassVar[str]
    capabilities: ClassVar[BackendCapabilities]

    @classmethod
    def validate(cls, request: BackendRequest) -> list[str]:
        """Called by the selector at startup; returns the reasons it cannot serve (empty: it can)."""
        ...

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, spec: KVCacheSpec) -> tuple[int, ...]:
        """Called by the runner when allocating a layer's cache; num_blocks includes the null block."""
        ...

    @classmethod
    def get_metadata_builder(cls, device: torch.device) -> AttentionMetadataBuilder: ...

    @classmethod
    def get_impl(cls, layer: AttentionLayerConfig) -> AttentionImpl: ...
