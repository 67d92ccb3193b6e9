"""The CUDA platform: NVIDIA GPUs, NCCL, CUDA graphs for decode steps, the Triton backends first."""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch

from keel.platform import CommunicatorSpec, GraphCaptureSpec, Platform, PlatformError

# Decode batch sizes captured as CUDA graphs: a batch is padded up to the next one (at most 1/8 padding past 256).
# The model runner captures those up to max_num_seqs, so the large buckets cost startup only to engines that can
# run such batches; up to 1024 rows, a full batch never falls back to eager steps (vLLM's default stops at 512).
CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, 8, *range(16, 257, 16), *range(288, 513, 32), *range(576, 1025, 64))


class CudaPlatform(Platform):
    """Registered as `cuda` by the `platform-cuda` plugin. Auto-detection prefers it over the CPU.

    Local rank i uses visible device i (`CUDA_VISIBLE_DEVICES` chooses which physical GPUs are
    visible); the worker calls `device(i)`, which also makes it the current device.
    """

    name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    dist_backend: ClassVar[str] = "nccl"
    priority: ClassVar[int] = 100
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    supports_fp8: ClassVar[bool] = False
    supports_graph_capture: ClassVar[bool] = True

    @classmethod
    def is_available(cls) -> bool:
        # device_count() asks the driver without creating a context, so forking workers stays safe.
        try:
            return torch.cuda.device_count() > 0
        except Exception:  # noqa: BLE001 -- a broken driver means "not available", never a crash
            return False

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def device(self, index: int = 0) -> torch.device:
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise PlatformError(
                f"local rank {index} needs CUDA device {index}, but {count} are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
                "lower tensor_parallel_size or make more GPUs visible"
            )
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def total_memory(self, index: int = 0) -> int:
        return int(torch.cuda.mem_get_info(index)[1])

    def free_memory(self, index: int = 0) -> int:
        return int(torch.cuda.mem_get_info(index)[0])

    def synchronize(self, index: int = 0) -> None:
        torch.cuda.synchronize(index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def reset_peak_memory_stats(self, index: int = 0) -> None:
        torch.cuda.reset_peak_memory_stats(index)

    def peak_memory_allocated(self, index: int = 0) -> int | None:
        return int(torch.cuda.max_memory_allocated(index))

    def memory_allocated(self, index: int = 0) -> int | None:
        return int(torch.cuda.memory_allocated(index))

    def adjust_config(self, config: Any) -> dict[str, dict[str, Any]]:
        dtype = config.model.torch_dtype if config.model is not None else None
        if dtype is not None and dtype not in self.supported_dtypes:
            raise PlatformError(f"dtype {dtype} is not supported on cuda; use one of {self.supported_dtypes}")
        if dtype == torch.bfloat16 and self.is_available() and not torch.cuda.is_bf16_supported():
            raise PlatformError("this GPU has no bfloat16 support (compute capability < 8.0); use dtype float16")
        return {}

    def attention_backend_preference(self) -> list[str]:
        return ["triton_flash", "triton_mla", "torch_paged", "torch_mla"]

    def communicator(self) -> CommunicatorSpec:
        return CommunicatorSpec(dist_backend="nccl",
                                device_communicator="keel_platform_cuda.communicator:NcclCommunicator")

    def graph_capture(self) -> GraphCaptureSpec:
        return GraphCaptureSpec(supported=True, batch_sizes=CAPTURE_SIZES,
                                capturer="keel.worker.cuda_graph:DecodeGraphRunner")

    def use_custom_ops(self) -> bool:
        # A batch-1 decode step is ~500 tiny norm/rope/activation kernels; fused ones cut most of them.
        return True

    def required_custom_ops(self) -> tuple[str, ...]:
        # The torch MoE experts path reads which experts have work back to the host in every layer: it
        # cannot be captured in a CUDA graph, and on an H200 it ran 13-42x slower than the fused kernel.
        return ("fused_experts",)
