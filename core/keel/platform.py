"""Platform: what the core needs to know about a hardware target, and how one is selected.

A platform class is registered under the `platform` kind. `select_platform` (called once per process
at startup, by `EngineArgs.create_engine_config` and by every worker) instantiates the one the profile
names, or auto-detects: it asks every registered class `is_available()` and keeps the highest
`priority`. The CPU platform has the lowest priority, so any available accelerator wins over it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from keel.plugins.errors import PluginError, PluginLoadError

if TYPE_CHECKING:
    import torch

    from keel.config import EngineConfig
    from keel.plugins.loader import PluginSet

logger = logging.getLogger("keel.platform")


class PlatformError(PluginError):
    """The requested platform cannot be used here (not available, or none available at all)."""


@dataclass(frozen=True)
class CommunicatorSpec:
    """How workers of this platform talk: a torch.distributed backend and an optional device
    communicator ("module:attr", built by keel.distributed) for faster collectives."""

    dist_backend: str
    device_communicator: str | None = None


@dataclass(frozen=True)
class GraphCaptureSpec:
    """The platform's strategy for the static decode part: captured batch sizes, or unsupported.

    `capturer` is a "module:attr" reference resolved by the model runner only when capture is on.
    """

    supported: bool = False
    batch_sizes: tuple[int, ...] = ()
    capturer: str | None = None


class Platform:
    """Base class of every platform plugin. Subclasses set the class attributes and override queries.

    Instances are cheap and hold no device state; the model runner and worker call the methods.
    """

    name: ClassVar[str] = ""
    device_type: ClassVar[str] = ""  # torch device type: "cpu", "cuda", ...
    dist_backend: ClassVar[str] = "gloo"
    priority: ClassVar[int] = 0  # auto-detection keeps the highest available
    supported_dtypes: ClassVar[tuple[Any, ...]] = ()  # torch dtypes, float32 first where supported
    supports_fp8: ClassVar[bool] = False
    supports_graph_capture: ClassVar[bool] = False

    @classmethod
    def is_available(cls) -> bool:
        """Called by `select_platform` at startup. Must be fast and must not raise or initialize
        the device in a way that breaks forking workers later."""
        raise NotImplementedError

    def device_count(self) -> int:
        """How many ranks this host can run (one per device); called by the `uni` and `mp` executors when
        validating the world size (TP x PP x DP) at startup. A larger world size is a startup error, never
        a silent fallback."""
        return 1

    def configure_worker_process(self, local_rank: int, local_world_size: int) -> None:
        """Called once in each worker process of a multi-rank executor, before the worker starts:
        process-wide settings for sharing the host (e.g. the CPU platform splits the host's threads)."""

    def device(self, index: int = 0) -> torch.device:
        """The torch device of local rank `index`; called by the worker when it starts."""
        import torch

        return torch.device(self.device_type, index) if self.device_type != "cpu" else torch.device("cpu")

    def total_memory(self, index: int = 0) -> int:
        """Bytes of device memory; called by the worker when sizing the KV cache."""
        raise NotImplementedError

    def free_memory(self, index: int = 0) -> int:
        """Bytes free now (<= total_memory); called after the memory-profiling forward pass."""
        raise NotImplementedError

    def synchronize(self, index: int = 0) -> None:
        """Wait for queued device work; called before timing and memory measurements."""

    def empty_cache(self) -> None:
        """Return cached allocator memory; called after profiling, before allocating the KV cache."""

    def reset_peak_memory_stats(self, index: int = 0) -> None:
        """Start a peak-memory measurement; called by the worker before the profiling forward pass."""

    def peak_memory_allocated(self, index: int = 0) -> int | None:
        """Most bytes the framework's allocator held since the last reset, or None if unknown (then the
        worker sizes the KV cache without an activation profile)."""
        return None

    def memory_allocated(self, index: int = 0) -> int | None:
        """Bytes the framework's allocator holds now, or None if unknown."""
        return None

    def adjust_config(self, config: EngineConfig) -> dict[str, dict[str, Any]]:
        """Called once by `create_engine_config`: a patch `{section: {field: value}}` for settings this
        platform cannot honour (e.g. `{"device": {"enforce_eager": True}}`). Never edits `config`.
        An unsupported dtype should be reported here as a PlatformError, not silently changed."""
        return {}

    def attention_backend_preference(self) -> list[str]:
        """`attention_backend` registry keys, best first; walked by the attention selector on auto."""
        return []

    def communicator(self) -> CommunicatorSpec:
        """Called by keel.distributed when it creates the process groups."""
        return CommunicatorSpec(dist_backend=self.dist_backend)

    def graph_capture(self) -> GraphCaptureSpec:
        """Called by the model runner after warm-up unless `enforce_eager`."""
        return GraphCaptureSpec(supported=False)

    def use_custom_ops(self) -> bool:
        """Called by the worker once, after the model is loaded: whether to bind the `custom_op`
        registry's fused kernels into the model's layers. False keeps every layer on its native torch
        math (the CPU path stays bit-exact with transformers); accelerators where small-kernel launch
        overhead matters return True."""
        return False

    def required_custom_ops(self) -> tuple[str, ...]:
        """Called by the worker with `use_custom_ops()` True, when it binds: custom op names whose native
        torch math this platform cannot serve. A model layer declaring one that gets no provider stops
        startup (`keel.layers.custom_op.MissingCustomOpError`) instead of running the native path."""
        return ()

    def use_startup_warm_up(self) -> bool:
        """Called by the worker once, after the model is loaded: whether to run a dummy step of every
        size a step can take (`Worker.warm_up`), so JIT-compiled kernels are built before serving. The
        default follows the platform's own device type, never the device a tensor happens to be on:
        platforms that run on the host (the CPU) compile nothing worth it."""
        return self.device_type not in ("", "cpu")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device_type={self.device_type!r})"


def _load_class(plugins: PluginSet, key: str, strict: bool) -> type[Platform] | None:
    try:
        return plugins.registry("platform").get(key)
    except PluginLoadError as exc:
        if strict:
            raise
        logger.warning("platform %r skipped during auto-detection: %s", key, exc)
        return None


def select_platform(config: EngineConfig | str, plugins: PluginSet) -> Platform:
    """The platform instance for `config.device.platform` (a registry key, or "auto").

    A named platform that is not registered or not available is an error; auto-detection with no
    available platform is an error listing what was tried.
    """
    requested = config if isinstance(config, str) else config.device.platform
    registry = plugins.registry("platform")
    if requested != "auto":
        cls = registry.get(requested)  # UnknownKeyError lists the registered platforms
        if not cls.is_available():
            raise PlatformError(
                f"platform {requested!r} (from {registry.provider(requested)}) is not available on this "
                "machine; choose another `platform:` in the profile or use `platform: auto`"
            )
        return cls()
    candidates: list[tuple[int, str, type[Platform]]] = []
    tried: list[str] = []
    for key in registry:
        cls = _load_class(plugins, key, strict=not plugins.auto)
        if cls is None:
            tried.append(f"{key}: failed to import")
            continue
        available = cls.is_available()
        logger.info("platform %r: available=%s priority=%d", key, available, cls.priority)
        tried.append(f"{key}: {'available' if available else 'not available'}")
        if available:
            candidates.append((cls.priority, key, cls))
    if not candidates:
        raise PlatformError(
            f"no available platform among registered ones ({'; '.join(tried) or 'none registered'}); "
            "install a platform plugin (keel-platform-cpu is the default) and list it in `plugins:`"
        )
    priority, key, cls = max(candidates, key=lambda c: c[0])
    logger.info("auto-selected platform %r (priority %d)", key, priority)
    return cls()
