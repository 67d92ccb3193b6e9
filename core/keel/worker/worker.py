"""Worker: owns one device, the model, its KV cache tensors and the model runner.

The engine core (through an executor) calls, in order: `load_model`, `kv_cache_spec`,
`determine_num_blocks`, `initialize_kv_cache`, then `execute_model` every step.
"""

from __future__ import annotations

import logging
import math

import torch

from keel.attention.backend import AttentionLayerConfig, BackendRequest
from keel.attention.selector import select_attention_backend
from keel.config import EngineConfig
from keel.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from keel.models.interface import ModelBuildContext
from keel.models.loader import load_model, resolve_model_path
from keel.worker.model_runner import ModelRunner

logger = logging.getLogger("keel.worker")

# On a platform without a device-memory budget (the CPU), the KV cache takes at most this share of
# free memory, and never more than the scheduler limits could ever use.
_HOST_KV_FRACTION = 0.25


class KVCacheSizeError(ValueError):
    pass


class Worker:
    def __init__(self, config: EngineConfig, plugins, platform) -> None:
        self.config = config
        self.plugins = plugins
        self.platform = platform
        self.device = platform.device(0)
        self.runner: ModelRunner | None = None
        self.num_blocks = 0
        self._backends: dict = {}

    def load_model(self) -> None:
        self.plugins.hooks.hook.keel_worker_init(config=self.config, rank=0)
        mc = self.config.model
        hf_config = mc.hf_config
        archs = list(getattr(hf_config, "architectures", None) or [])
        registry = self.plugins.registry("model_arch")
        arch = next((a for a in archs if a in registry.keys()), None)
        if arch is None:
            raise ValueError(
                f"no loaded plugin serves the architecture(s) {archs} of {mc.model!r}; "
                f"available: {sorted(registry.keys())}. Install or name the plugin that provides it."
            )
        model_cls = registry.get(arch)
        dtype = mc.torch_dtype
        block_size = self.config.cache.block_size
        build = ModelBuildContext(
            hf_config=hf_config, dtype=dtype, device=self.device, block_size=block_size,
            attention_backend=None, attention_selector=self._select_backend,
        )
        model = load_model(model_cls, build, resolve_model_path(mc.model, mc.revision))
        self.runner = ModelRunner(model, self.device, block_size)
        names = sorted({b.name for b in self._backends.values()})
        logger.info("loaded %s (%s, %s) with attention backend(s) %s", mc.model, arch, dtype, names)

    def _select_backend(self, layer: AttentionLayerConfig, kv_cache_kind: str):
        """Called by each attention layer as the model is built; one validated choice per layer kind."""
        key = (layer, kv_cache_kind)
        if key not in self._backends:
            request = BackendRequest(layer=layer, device_type=self.device.type, kv_cache_kind=kv_cache_kind)
            self._backends[key] = select_attention_backend(
                self.platform, request, self.config.device.attention_backend, self.plugins
            )
        return self._backends[key]

    def kv_cache_spec(self):
        return self.runner.kv_cache_spec()

    def determine_num_blocks(self, max_num_seqs: int, max_model_len: int) -> int:
        """Blocks to allocate, including the null block. Explicit settings win; otherwise a memory budget."""
        cache = self.config.cache
        spec = self.kv_cache_spec()
        per_block = self.runner.kv_cache_bytes_per_block()
        most_useful = max_num_seqs * math.ceil(max_model_len / spec.block_size) + 1
        if cache.num_kv_blocks is not None:
            num = cache.num_kv_blocks
        elif cache.kv_cache_memory_bytes is not None:
            num = cache.kv_cache_memory_bytes // per_block
        else:
            budget = self._default_budget_bytes()
            num = min(budget // per_block, most_useful)
        min_needed = math.ceil(max_model_len / spec.block_size) + 1
        if num < min_needed:
            raise KVCacheSizeError(
                f"the KV cache holds {num} blocks of {spec.block_size} tokens, fewer than one request of "
                f"max_model_len={max_model_len} needs ({min_needed}); raise num_kv_blocks / "
                f"kv_cache_memory_bytes or lower max_model_len"
            )
        return int(num)

    def _default_budget_bytes(self) -> int:
        if self.device.type == "cpu":
            return int(self.platform.free_memory() * _HOST_KV_FRACTION)
        # Device platforms: what gpu_memory_utilization leaves after weights (no activation profile yet).
        total = self.platform.total_memory()
        free = self.platform.free_memory()
        used_by_others = total - free
        return int(total * self.config.cache.gpu_memory_utilization - used_by_others)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)
