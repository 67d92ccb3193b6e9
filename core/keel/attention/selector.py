"""Choose the attention backend for a layer configuration.

Called by the worker at startup, once per distinct `BackendRequest`. With `requested="auto"` it walks
the platform's `attention_backend_preference()` then every other registered backend, and returns the
first whose `validate` reports no reason; every rejection is logged (logger "keel.attention") so a
user sees why the fast kernel was not picked. A named backend that rejects is an error, never a
silent fallback.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from keel.attention.backend import BackendRequest
from keel.plugins.errors import PluginError, PluginLoadError

if TYPE_CHECKING:
    from keel.platform import Platform
    from keel.plugins.loader import PluginSet

logger = logging.getLogger("keel.attention")


class AttentionBackendError(PluginError):
    """No attention backend can serve the request; the message lists every backend's reasons."""


def _describe(request: BackendRequest) -> str:
    layer = request.layer
    return (
        f"heads={layer.num_heads}/{layer.num_kv_heads} head_size={layer.head_size} dtype={layer.dtype} "
        f"block_size={layer.block_size} device={request.device_type} kv_cache={request.kv_cache_kind}"
        + (" mla" if layer.use_mla else "")
        + (f" sliding_window={layer.sliding_window}" if layer.sliding_window is not None else "")
    )


def candidate_order(platform: Platform, plugins: PluginSet) -> list[str]:
    """Registered backend keys: the platform's preference first, then the rest in load order."""
    registered = plugins.registry("attention_backend").keys()
    preferred = [k for k in platform.attention_backend_preference() if k in registered]
    return preferred + [k for k in registered if k not in preferred]


def select_attention_backend(
    platform: Platform, request: BackendRequest, requested: str, plugins: PluginSet
) -> Any:
    """The backend class for `request`: the one named by `requested`, or the first fitting on "auto"."""
    registry = plugins.registry("attention_backend")
    if requested != "auto":
        backend = registry.get(requested)  # UnknownKeyError lists the registered backends
        reasons = backend.validate(request)
        if reasons:
            raise AttentionBackendError(
                f"attention backend {requested!r} ({registry.provider(requested)}) cannot serve "
                f"[{_describe(request)}]: {'; '.join(reasons)}. "
                "Use `attention_backend: auto` or another backend"
            )
        logger.info("attention backend %r selected (requested)", requested)
        return backend
    for key in platform.attention_backend_preference():
        if key not in registry:
            logger.info("attention backend %r (preferred by platform %r) is not loaded", key, platform.name)
    rejections: list[str] = []
    for key in candidate_order(platform, plugins):
        try:
            backend = registry.get(key)
        except PluginLoadError as exc:
            if not plugins.auto:
                raise
            logger.warning("attention backend %r skipped: %s", key, exc)
            rejections.append(f"{key}: failed to import ({exc.cause})")
            continue
        reasons = backend.validate(request)
        if not reasons:
            logger.info("attention backend %r selected for [%s]", key, _describe(request))
            return backend
        logger.info("attention backend %r rejected: %s", key, "; ".join(reasons))
        rejections.append(f"{key}: {'; '.join(reasons)}")
    detail = " | ".join(rejections) if rejections else "no attention backend is registered"
    raise AttentionBackendError(
        f"no attention backend can serve [{_describe(request)}] on platform {platform.name!r}: {detail}. "
        "Install or list a plugin providing a suitable backend (e.g. attention-torch)"
    )
