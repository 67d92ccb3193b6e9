"""Per-layer scales of an FP8 KV cache: real key = fp8 key * k_scale (values: v_scale; MLA's latent: k_scale).

An attention layer whose cache is stored in fp8 registers `k_scale` and `v_scale` (float32 [1], 1.0 unless
the checkpoint has them: vLLM / llm-compressor checkpoints store `self_attn.k_scale` and
`self_attn.v_scale`, which `load_mapped_weights` routes to the attention layer under `self_attn`). They are
optional parameters: a checkpoint without them keeps 1.0. The layer hands them to its backend impl once
(`set_kv_scales`); a backend that stores fp8 caches must accept them, so a checkpoint's scales are never
silently ignored. Every backend stores `quantize_kv`'s bytes (the Triton ones compute them in their write
kernels); the torch backends read (fp8 value as float32 * scale) rounded to the model dtype, the Triton ones
fold the scales out of their tiles (k_scale into the scores, v_scale into the output).
"""

from __future__ import annotations

import torch

from keel.layers.fp8_utils import FP8_MAX
from keel.models.weights import set_weight_attrs

KV_SCALE_NAMES = ("k_scale", "v_scale")


def register_kv_scales(layer: torch.nn.Module, impl: object, backend_name: str) -> None:
    """Called by the attention layers after building their impl, when the cache is fp8."""
    for name in KV_SCALE_NAMES:
        p = torch.nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(p, optional=True, weight_loader=_load_scale)
        layer.register_parameter(name, p)
    bind = getattr(impl, "set_kv_scales", None)
    if bind is None:
        raise TypeError(f"attention backend {backend_name!r} stores fp8 KV caches but its impl has no "
                        "set_kv_scales(k_scale, v_scale); it would ignore a checkpoint's per-layer scales")
    bind(layer.k_scale, layer.v_scale)


def _load_scale(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """A checkpoint scale: a scalar or [1] (vLLM writes scalars), finite and positive."""
    from keel.models.weights import WeightLoadError

    value = loaded.float().reshape(-1) if loaded.numel() == 1 else None
    if value is None or not bool(torch.isfinite(value).all() and (value > 0).all()):
        raise WeightLoadError(f"a KV cache scale must be one finite positive number, got shape "
                              f"{tuple(loaded.shape)}" + (f" value {float(value)}" if value is not None else ""))
    param.data.copy_(value)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale saturated to the e4m3 range, in the cache `dtype` (torch's cast alone turns overflow to NaN)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def kv_scale_aliases(param_names: list[str]) -> dict[str, str]:
    """Checkpoint name -> parameter name for the KV scales: `a.self_attn.k_scale` -> `a.self_attn.attn.k_scale`
    (the attention layer is a child of the module the checkpoint names)."""
    out = {}
    for name in param_names:
        head, _, leaf = name.rpartition(".")
        if leaf in KV_SCALE_NAMES and "." in head:
            out[f"{head.rpartition('.')[0]}.{leaf}"] = name
    return out
