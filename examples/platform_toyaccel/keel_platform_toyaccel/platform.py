"""ToyAccel: a stand-in for a vendor accelerator. It computes on the host CPU (torch device "cpu") so
the example runs anywhere, but it has its own identity, memory budget and priority, like real hardware.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch

from keel.platform import CommunicatorSpec, GraphCaptureSpec, Platform, PlatformError


class ToyAccelPlatform(Platform):
    name: ClassVar[str] = "toyaccel"
    device_type: ClassVar[str] = "cpu"  # a real plugin: its torch device type ("cuda", "xpu", "npu", ...)
    dist_backend: ClassVar[str] = "gloo"  # a real plugin: its collective library ("nccl", "hccl", ...)
    priority: ClassVar[int] = 50  # above the CPU platform: `platform: auto` prefers it when it is available
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16)

    @classmethod
    def is_available(cls) -> bool:
        # A real plugin probes its driver here, cheaply and without raising. The toy has no driver: it is
        # available only where TOYACCEL_VISIBLE_DEVICES names devices, so installing it never outranks
        # the CPU platform on a machine that has no ToyAccel.
        return os.environ.get("TOYACCEL_VISIBLE_DEVICES", "") != ""

    def total_memory(self, index: int = 0) -> int:
        return int(os.environ.get("TOYACCEL_MEMORY_BYTES", str(8 * 2**30)))

    def free_memory(self, index: int = 0) -> int:
        return self.total_memory(index) // 2

    def adjust_config(self, config: Any) -> dict[str, dict[str, Any]]:
        if config.model is not None and config.model.dtype not in ("auto", "float32", "float", "bfloat16"):
            raise PlatformError(f"toyaccel supports float32 and bfloat16, not {config.model.dtype!r}")
        patch: dict[str, dict[str, Any]] = {"device": {"enforce_eager": True}}  # no graph capture
        if config.cache.block_size % 32:
            patch["cache"] = {"block_size": 32}  # its kernels tile KV blocks by 32 tokens
        return patch

    def attention_backend_preference(self) -> list[str]:
        return ["torch_paged"]

    def communicator(self) -> CommunicatorSpec:
        return CommunicatorSpec(dist_backend=self.dist_backend)

    def graph_capture(self) -> GraphCaptureSpec:
        return GraphCaptureSpec(supported=False)
