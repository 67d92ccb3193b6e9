"""The CPU platform: always available, lowest priority, no graph capture."""

from __future__ import annotations

import os
from typing import ClassVar

import torch

from keel.platform import CommunicatorSpec, GraphCaptureSpec, Platform


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes; empty off Linux."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        pass
    return out


def _sysconf_total() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


class CpuPlatform(Platform):
    name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    priority: ClassVar[int] = -100
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    supports_fp8: ClassVar[bool] = False
    supports_graph_capture: ClassVar[bool] = False
    # CPU "devices" are gloo processes sharing the host's cores: any number would run, so the limit is
    # explicit. Beyond it a tensor_parallel_size is a startup error, not a slow surprise.
    max_ranks: ClassVar[int] = 8

    @classmethod
    def is_available(cls) -> bool:
        return True

    def device_count(self) -> int:
        return self.max_ranks

    def configure_worker_process(self, local_rank: int, local_world_size: int) -> None:
        # Ranks share the host's cores; each taking all of them would oversubscribe every core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))

    def device(self, index: int = 0) -> torch.device:
        # One host device: every local rank shares it.
        return torch.device("cpu")

    def total_memory(self, index: int = 0) -> int:
        total = _meminfo().get("MemTotal", 0) or _sysconf_total()
        if total <= 0:
            raise RuntimeError("cannot determine host memory (no /proc/meminfo, no sysconf)")
        return total

    def free_memory(self, index: int = 0) -> int:
        info = _meminfo()
        free = info.get("MemAvailable", info.get("MemFree", 0))
        if free <= 0:
            # Without a reliable reading, claim nothing is free rather than over-allocate the cache.
            return 0
        return min(free, self.total_memory(index))

    def adjust_config(self, config) -> dict[str, dict[str, object]]:
        from keel.platform import PlatformError

        dtype = config.model.torch_dtype if config.model is not None else None
        if dtype is not None and dtype not in self.supported_dtypes:
            raise PlatformError(f"dtype {dtype} is not supported on cpu; use one of {self.supported_dtypes}")
        patch: dict[str, dict[str, object]] = {}
        # No graphs to capture on CPU: running eagerly is the only mode.
        if not config.device.enforce_eager:
            patch["device"] = {"enforce_eager": True}
        return patch

    def attention_backend_preference(self) -> list[str]:
        # The torch references first: the Triton backends accept the CPU under TRITON_INTERPRET=1 (a test
        # mode), which must not make `auto` trade torch_mla for the interpreted triton_mla.
        return ["torch_paged", "torch_mla", "triton_flash", "triton_mla"]

    def communicator(self) -> CommunicatorSpec:
        return CommunicatorSpec(dist_backend="gloo")

    def graph_capture(self) -> GraphCaptureSpec:
        return GraphCaptureSpec(supported=False)
