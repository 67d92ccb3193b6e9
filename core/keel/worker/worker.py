"""Worker: owns one device (one rank), the model's shard, its KV cache tensors and the model runner.

Its executor calls, in order: `init_device` (device and process groups), then on behalf of the engine
core `load_model`, `warm_up`, `determine_num_blocks`, `initialize_kv_cache`, `kv_cache_spec`, then
`execute_model` every step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

from keel.attention.backend import AttentionLayerConfig, BackendRequest
from keel.attention.selector import select_attention_backend
from keel.config import EngineConfig
from keel.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from keel.gc_heap import freeze_startup_heap, thaw_heap
from keel.layers.custom_op import bind_custom_ops
from keel.logits_processor import resolve_logits_processors
from keel.models.capabilities import supports
from keel.models.interface import ModelBuildContext
from keel.models.loader import load_model, resolve_model_path
from keel.models.registry import ModelRegistry
from keel.quantization import quantization_for_model
from keel.spec_decode.proposer import ProposerContext
from keel.worker.async_output import AsyncModelRunnerOutput
from keel.worker.model_runner import ModelRunner

logger = logging.getLogger("keel.worker")

# On a platform without a device-memory budget (the CPU), the KV cache takes at most this share of
# free memory, and never more than the scheduler limits could ever use.
_HOST_KV_FRACTION = 0.25


class KVCacheSizeError(ValueError):
    pass


class Worker:
    def __init__(self, config: EngineConfig, plugins, platform, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: str | None = None, local_world_size: int = 1) -> None:
        self.config = config
        self.plugins = plugins
        self.platform = platform
        self.rank = rank
        self.local_rank = local_rank
        self.local_world_size = local_world_size  # ranks sharing this host
        self.distributed_init_method = distributed_init_method
        self.device = platform.device(local_rank)
        self.dist = None  # keel.distributed.parallel_state.DistributedState, after init_device
        self.runner: ModelRunner | None = None
        self.num_blocks = 0
        self._backends: dict = {}

    def init_device(self) -> None:
        """Called by the executor once, right after construction: join the rank grid (process groups
        through the platform's communicator) before any model is built."""
        from keel.distributed.grid import RankGrid
        from keel.distributed.parallel_state import init_distributed_environment

        grid = RankGrid.from_config(self.config.parallel)
        self.dist = init_distributed_environment(grid, self.rank, self.platform.communicator(),
                                                 self.distributed_init_method)

    def distributed_info(self) -> dict[str, str | float | None]:
        """Called through `collective_rpc` (on every rank at once: it runs a collective) by diagnostics
        and tests: how this rank talks to the others -- torch.distributed backend (None when not joined),
        the TP group's device communicator class, and the sum of a one-element all-reduce over the TP
        group on this rank's device (its size when the path works)."""
        import torch
        import torch.distributed as dist

        tp = self.dist.tp
        comm = tp.device_communicator
        ones = tp.all_reduce(torch.ones(1, device=self.device))
        return {"backend": dist.get_backend() if dist.is_initialized() else None,
                "tp_group": repr(tp),
                "device_communicator": None if comm is None else type(comm).__qualname__,
                "tp_all_reduce": float(ones.item())}

    def load_model(self) -> None:
        if self.dist is None:
            self.init_device()
        self.plugins.hooks.hook.keel_worker_init(config=self.config, rank=self.rank)
        self._build_model()

    def _build_model(self) -> None:
        """The model (checkpoint weights, custom ops bound) and its runner; again on a level-2 wake-up."""
        mc = self.config.model
        hf_config = mc.hf_config
        model_cls, arch = ModelRegistry(self.plugins).resolve_hf_config(hf_config, mc.model)
        tp = self.dist.tp
        if tp.world_size > 1 and not supports(model_cls, "tensor_parallel"):
            raise NotImplementedError(
                f"{arch} ({model_cls.__module__}) does not support tensor parallelism yet: "
                f"use tensor_parallel_size=1 (got {tp.world_size})"
            )
        pp = self.dist.pp
        if pp.world_size > 1 and not supports(model_cls, "pipeline_parallel"):
            raise NotImplementedError(
                f"{arch} ({model_cls.__module__}) does not support pipeline parallelism yet: "
                f"use pipeline_parallel_size=1 (got {pp.world_size})"
            )
        if pp.world_size > 1 and self.config.speculative is not None:
            raise NotImplementedError("speculative decoding with pipeline_parallel_size > 1 is not supported yet")
        dp = self.dist.dp
        if dp.world_size > 1 and self.config.speculative is not None:
            raise NotImplementedError("speculative decoding with data_parallel_size > 1 is not supported yet")
        if self.config.parallel.enable_expert_parallel and not supports(model_cls, "moe"):
            raise NotImplementedError(f"enable_expert_parallel is set, but {arch} has no MoE layers to shard")
        if mc.disable_shared_experts_fusion and not supports(model_cls, "moe"):
            raise NotImplementedError(f"disable_shared_experts_fusion is set, but {arch} has no MoE layers")
        dtype = mc.torch_dtype
        block_size = self.config.cache.block_size
        quant = quantization_for_model(self.config, model_cls, self.platform, dtype)
        build = ModelBuildContext(
            hf_config=hf_config, dtype=dtype, device=self.device, block_size=block_size,
            attention_backend=None, attention_selector=self._select_backend, quant_method=quant,
            tp_size=tp.world_size, tp_rank=tp.rank_in_group,
            enable_expert_parallel=self.config.parallel.enable_expert_parallel,
            dp_size=dp.world_size, dp_rank=dp.rank_in_group,
            pp_size=pp.world_size, pp_rank=pp.rank_in_group,
            kv_cache_dtype=self.config.cache.torch_kv_cache_dtype(),
            disable_shared_experts_fusion=mc.disable_shared_experts_fusion,
        )
        path = resolve_model_path(mc.model, mc.revision)
        model = load_model(model_cls, build, path, load_format=mc.load_format)
        proposer, num_spec = self._make_proposer(model, build, path)
        stage = None
        if pp.world_size > 1:
            from keel.distributed.pipeline import PipelineStage

            stage = PipelineStage(pp, hf_config.hidden_size, dtype, self.device)
        procs = [cls(self.config, self.device, self.device.type == "cuda")
                 for cls in resolve_logits_processors(mc.logits_processors, self.plugins)]
        # Experts sharded over the DP ranks need every rank in every step's collectives (idle ones too).
        dp_lockstep = dp.world_size > 1 and build.enable_expert_parallel and supports(model_cls, "moe")
        self.runner = ModelRunner(model, self.device, block_size, proposer, num_spec,
                                  max_model_len=mc.derived_max_model_len, pipeline=stage, logits_processors=procs,
                                  dp_lockstep=dp_lockstep, max_num_seqs=self.config.scheduler.max_num_seqs)
        if self.platform.use_custom_ops():
            # Bound before warm-up and graph capture, so they already run the fused kernels; a draft model's
            # own layers (an MTP module) get the same kernels, and the runner's grammar-mask step its own.
            registry, required = self.plugins.registry("custom_op"), self.platform.required_custom_ops()
            for module in (model, *getattr(proposer, "draft_modules", tuple)(), self.runner.token_bitmask):
                bind_custom_ops(module, registry, self.device.type, dtype, required=required)
        names = sorted({b.name for b in self._backends.values()})
        logger.info("loaded %s (%s, %s%s) with attention backend(s) %s", mc.model, arch, dtype,
                    f", quantization {quant.name}" if quant is not None else "", names)

    def _make_proposer(self, model, build: ModelBuildContext, path) -> tuple[object | None, int]:
        spec = self.config.speculative
        if spec is None:
            return None, 0
        proposer_cls = self.plugins.registry("spec_decoder").get(spec.method)
        options = tuple((k, v) for k, v in dataclasses.asdict(spec).items()
                        if k not in ("method", "num_speculative_tokens"))
        ctx = ProposerContext(spec.method, spec.num_speculative_tokens, options, model, self.device,
                              build=build, model_path=path,
                              load_format=self.config.model.load_format)
        return proposer_cls(ctx), spec.num_speculative_tokens

    def _select_backend(self, layer: AttentionLayerConfig, kv_cache_kind: str):
        """Called by each attention layer as the model is built; one validated choice per layer kind."""
        key = (layer, kv_cache_kind)
        if key not in self._backends:
            request = BackendRequest(layer=layer, device_type=self.device.type, kv_cache_kind=kv_cache_kind)
            self._backends[key] = select_attention_backend(
                self.platform, request, self.config.device.attention_backend, self.plugins
            )
        return self._backends[key]

    def warm_up(self) -> None:
        """Called by the engine core after `load_model`, before the KV cache is sized: on device platforms,
        compile the size-specialized kernels a step can select (see `ModelRunner.warm_up`). The platform
        decides (`Platform.use_startup_warm_up`): the CPU runs no JIT-compiled kernels worth it (and
        interpreted Triton would only be slow)."""
        if not self.platform.use_startup_warm_up():
            return
        sched = self.config.scheduler
        max_len = self.config.model.derived_max_model_len
        start = time.perf_counter()
        sizes = self.runner.warm_up(sched.max_num_batched_tokens or max_len, sched.max_num_seqs, max_len)
        self.platform.synchronize()
        self.platform.empty_cache()
        logger.info("warmed up steps of %s tokens in %.1f s", sizes, time.perf_counter() - start)

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
            # Every local rank sizes its cache from the same host memory: split the share between them.
            return int(self.platform.free_memory() * _HOST_KV_FRACTION / self.local_world_size)
        # Device platforms: what gpu_memory_utilization leaves after weights, other processes and the
        # activation peak of the largest step (measured by a dummy forward when the platform can).
        activation = self._profile_activation_bytes()
        total = self.platform.total_memory()
        free = self.platform.free_memory()
        used_by_others = total - free
        budget = int(total * self.config.cache.gpu_memory_utilization - used_by_others - activation)
        logger.info("KV cache budget %.2f GiB (total %.1f GiB x %.2f, in use %.2f GiB, activation peak %.2f GiB)",
                    budget / 2**30, total / 2**30, self.config.cache.gpu_memory_utilization,
                    used_by_others / 2**30, activation / 2**30)
        return budget

    def _profile_activation_bytes(self) -> int:
        """Peak bytes a forward of the largest step allocates beyond the weights (0 if not measurable)."""
        p = self.platform
        if p.memory_allocated() is None:
            return 0
        sched = self.config.scheduler
        max_len = self.config.model.derived_max_model_len
        num_tokens = sched.max_num_batched_tokens or max_len
        p.synchronize()
        p.empty_cache()
        before = p.memory_allocated()
        p.reset_peak_memory_stats()
        temp_cache = self.runner.profile_run(num_tokens, sched.max_num_seqs, max_len)
        p.synchronize()
        peak = p.peak_memory_allocated() or before
        p.empty_cache()
        return max(0, peak - before - temp_cache)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.runner.initialize_kv_cache(num_blocks)
        if not self.config.device.enforce_eager:
            self.runner.capture_cuda_graphs(self.platform.graph_capture(), self.config.scheduler.max_num_seqs,
                                            self.config.model.derived_max_model_len)
        freeze_startup_heap()

    # -- sleep mode: called by the engine core (LLM.sleep / wake_up) with no request in flight ----------

    def sleep(self, level: int) -> None:
        """Level 1 frees the KV cache (the weights stay where they are); level 2 frees the weights too."""
        import gc

        thaw_heap()  # a frozen reference cycle through the model or the cache would never be freed
        self.runner.free_kv_cache()
        if level == 2:
            self.runner = None  # the model and everything built on it
        gc.collect()
        self.platform.empty_cache()
        logger.info("asleep (level %d): KV cache%s freed", level, " and weights" if level == 2 else "")

    def wake_up(self, tags: tuple[str, ...]) -> None:
        """Restore what `sleep` freed, of `tags` ("weights": reloaded from the checkpoint; "kv_cache":
        allocated again, zeroed, with its decode graphs); what is awake already is left alone."""
        if "weights" in tags and self.runner is None:
            self._build_model()
        if "kv_cache" in tags and (self.runner is None or not self.runner.has_kv_cache):
            if self.runner is None:
                raise ValueError("the weights are asleep: wake them before the KV cache (tags=['weights'])")
            self.initialize_kv_cache(self.num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Enqueue the step; its output comes from `get_output()` (async scheduling)."""
        return self.runner.execute_model_async(scheduler_output)
