"""Custom ops: fused kernels that plugins register for the elementwise math of core layers.

A layer class names the ops it can delegate in `custom_ops` (e.g. `RMSNorm.custom_ops =
("rms_norm", "fused_add_rms_norm")`) and reads its instance's `bound_ops` mapping in `forward`, falling
back to its native torch math for an op that is not bound. Plugins register providers under the
`custom_op` registry kind, keyed by op name. After the model is built and loaded -- and only when the
platform's `use_custom_ops()` says so -- the worker calls `bind_custom_ops`, which resolves each op
named by the model's layers to its provider (if that provider supports the device and dtype) and binds
it into those layer instances. Nothing is module-global: an unbound model is untouched.

Op contracts (every op returns new tensors and leaves its inputs unchanged, like the native layers):

    rms_norm(x, weight, eps) -> out
        x: [..., hidden]; weight: [hidden]; out like `weight * norm(x).to(x.dtype)`.
    fused_add_rms_norm(x, residual, weight, eps) -> (out, new_residual)
        new_residual = x + residual (in the input dtype); out = rms_norm(new_residual, weight, eps).
    rotary_embedding(positions, q, k, cos_cache, sin_cache, head_size, rotary_dim) -> (q_out, k_out)
        neox rope on the first rotary_dim dims of each head; positions: [n] int; q: [n, heads * head_size];
        k: [n, kv_heads * head_size]; cos/sin_cache: [cache_len, rotary_dim] float32 (halves repeated).
    silu_and_mul(x) -> out
        x: [..., 2 * d]; out: [..., d] = silu(x[..., :d]) * x[..., d:].
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

logger = logging.getLogger("keel.custom_op")

CUSTOM_OP_NAMES: tuple[str, ...] = ("fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul")


@runtime_checkable
class CustomOpProvider(Protocol):
    """A registered `custom_op` entry (a class; the worker instantiates it with no arguments).

    `supports` is called once per op at bind time, after the model is loaded; `__call__` is called by
    the bound layers on every forward (also inside captured CUDA graphs), with the op's contract as in
    this module's docstring, and must match the layer's native math within the dtype's rounding.
    """

    def supports(self, device_type: str, dtype: torch.dtype) -> bool: ...

    def __call__(self, *args: Any) -> Any: ...


class CustomOpError(TypeError):
    """A registered custom op provider does not implement the provider protocol."""


def _resolve(registry: Any, name: str, device_type: str, dtype: torch.dtype) -> Callable[..., Any] | None:
    if name not in registry:
        return None
    entry = registry.get(name)
    provider = entry() if isinstance(entry, type) else entry
    if not isinstance(provider, CustomOpProvider):
        raise CustomOpError(
            f"custom_op {name!r} from {registry.provider(name)} must have supports(device_type, dtype) and "
            f"be callable; got {type(provider).__name__}"
        )
    if not provider.supports(device_type, dtype):
        logger.info("custom op %r (%s) does not support %s/%s; layers keep their native math",
                    name, registry.provider(name), device_type, dtype)
        return None
    return provider


def bind_custom_ops(
    model: torch.nn.Module, registry: Any, device_type: str, dtype: torch.dtype
) -> dict[str, int]:
    """Bind registered providers into every layer of `model` that declares `custom_ops`.

    Called by the worker once after loading, when `platform.use_custom_ops()`. `registry` is the
    `custom_op` registry. Returns op name -> number of layer instances it was bound into (ops with no
    supporting provider are absent). A provider is resolved at most once per op name.
    """
    resolved: dict[str, Callable[..., Any] | None] = {}
    counts: dict[str, int] = {}
    for module in model.modules():
        names = getattr(type(module), "custom_ops", ())
        if not names:
            continue
        bound = dict(getattr(module, "bound_ops", {}))
        for name in names:
            if name not in resolved:
                resolved[name] = _resolve(registry, name, device_type, dtype)
            op = resolved[name]
            if op is not None:
                bound[name] = op
                counts[name] = counts.get(name, 0) + 1
        if bound:
            module.bound_ops = bound
    if counts:
        logger.info("custom ops bound (%s, %s): %s", device_type, dtype,
                    ", ".join(f"{n} -> {registry.provider(n)} x{c}" for n, c in sorted(counts.items())))
    else:
        logger.info("no custom ops bound (%s, %s): registered %s", device_type, dtype, list(registry))
    return counts
