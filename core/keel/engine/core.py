"""EngineCore: the loop that owns the scheduler and drives the workers.

It sees only tokenized `EngineCoreRequest`s and emits `EngineCoreOutput`s: no tokenizer, no strings.
That keeps it movable to its own process behind an engine client.
"""

from __future__ import annotations

import logging
from collections import deque

from keel.config import EngineConfig
from keel.engine.core_output import EngineCoreOutput, SchedulerStats
from keel.engine.dp_scheduler import DataParallelScheduler
from keel.engine.request import EngineCoreRequest
from keel.engine.scheduler import Scheduler
from keel.gc_heap import freeze_startup_heap
from keel.kv_cache.manager import KVCacheManager
from keel.platform import select_platform
from keel.structured_output.backend import BackendContext
from keel.structured_output.manager import StructuredOutputManager, select_backend

logger = logging.getLogger("keel.engine")

WAKE_UP_TAGS = ("weights", "kv_cache")  # vLLM's, in the order they are restored


def resolve_async_scheduling(setting: bool | None, device_type: str, pipeline_parallel_size: int) -> bool:
    """`async_scheduling` as set, or by default on where the device runs apart from the host (not the CPU)
    and for pipeline stages (it is what feeds them micro-batches) -- with speculative decoding too."""
    if setting is not None:
        return setting
    return device_type != "cpu" or pipeline_parallel_size > 1


class EngineCore:
    def __init__(self, config: EngineConfig, plugins=None) -> None:
        self.config = config
        self.plugins = plugins if plugins is not None else config.plugin_set()
        self.platform = config.platform() if plugins is None else select_platform(config, plugins)
        self.max_model_len = config.model.derived_max_model_len
        sched = config.scheduler

        executor_cls = self.plugins.registry("executor").get(config.parallel.executor_backend)
        self.executor = executor_cls(config, self.plugins, self.platform)
        try:
            rpc = self.executor.collective_rpc
            rpc("load_model")
            rpc("warm_up")
            # Every rank sizes its own cache shard; the smallest count fits them all.
            num_blocks = min(rpc("determine_num_blocks", (sched.max_num_seqs, self.max_model_len)))
            rpc("initialize_kv_cache", (num_blocks,))
            spec = rpc("kv_cache_spec", unique_reply_rank=0)[0]
        except BaseException:
            self.executor.shutdown()
            raise
        self.num_kv_blocks = num_blocks
        pp = config.parallel.pipeline_parallel_size
        self.async_scheduling = resolve_async_scheduling(sched.async_scheduling, self.platform.device_type, pp)
        # Steps in flight: two overlap the host with the device; under pipeline parallelism one
        # micro-batch per stage keeps every stage busy.
        self.max_in_flight = max(2, pp) if self.async_scheduling else 1
        # A constrained request is scheduled while its token is in flight when the runner shares this
        # process: it receives the step's bitmask as a handle still being filled and waits for it only
        # right before sampling. Workers in other processes get the bitmask with the step, filled.
        # Not with speculative decoding: the bitmask plan needs the request's drafts on the host (a constrained
        # request then waits for its step in flight and verifies every other step).
        self.constrained_in_flight = (self.max_in_flight == 2 and pp == 1 and self.executor.in_process
                                      and config.speculative is None)
        # One scheduler per data-parallel replica, each over its own KV cache of num_blocks blocks.
        self._schedulers = [self._make_scheduler(spec, num_blocks) for _ in range(config.parallel.data_parallel_size)]
        self.scheduler = (self._schedulers[0] if len(self._schedulers) == 1
                          else DataParallelScheduler(self._schedulers))
        # Async scheduling: launched steps not yet applied, oldest first (at most max_in_flight).
        self._in_flight: deque = deque()
        self._hooks = self.plugins.hooks.hook
        self._shut_down = False
        self.sleep_level = 0  # 0 awake; 1 KV cache freed; 2 weights too (see sleep)
        self._hooks.keel_engine_start(config=config)
        freeze_startup_heap()
        logger.info(
            "engine ready: platform=%s, %d KV blocks of %d tokens, max_model_len=%d, async scheduling %s",
            self.platform.name, num_blocks - 1, spec.block_size, self.max_model_len,
            "on" if self.async_scheduling else "off",
        )

    def _make_scheduler(self, spec, num_blocks: int) -> Scheduler:
        config, sched = self.config, self.config.scheduler
        kv_manager = KVCacheManager(
            spec, num_blocks, enable_caching=config.cache.enable_prefix_caching,
            manager_classes={spec.kind: self.plugins.registry("kv_cache_spec").get(spec.kind)},
        )
        return Scheduler(
            kv_manager,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            num_spec_tokens=config.speculative.num_speculative_tokens if config.speculative else 0,
            async_scheduling=self.async_scheduling,
            structured_output=self._structured_output_manager(),
            scheduling_policy=sched.scheduling_policy,
            pipeline_depth=self.max_in_flight if config.parallel.pipeline_parallel_size > 1 else 1,
            constrained_in_flight=self.constrained_in_flight,
        )

    def _structured_output_manager(self) -> StructuredOutputManager | None:
        """None when no `structured_output` plugin is loaded, or when the front end refuses constrained
        requests anyway (no tokenizer)."""
        backend = select_backend(self.plugins)
        mc = self.config.model
        if backend is None or mc.skip_tokenizer_init:
            return None

        def context() -> BackendContext:
            # The core sees token ids only; the grammar library needs the vocabulary's strings.
            from keel.engine.llm_engine import _eos_token_id, load_tokenizer

            tokenizer = load_tokenizer(self.config)
            return BackendContext(tokenizer=tokenizer, vocab_size=mc.hf_config.vocab_size,
                                  eos_token_id=_eos_token_id(tokenizer, mc.hf_config))

        # Pinned bitmasks: the runner in this process copies them to the device without blocking.
        pin = self.executor.in_process and self.platform.device_type != "cpu"
        return StructuredOutputManager(backend, context, mc.hf_config.vocab_size, pin_memory=pin)

    @property
    def worker(self):
        """The in-process worker of the "uni" executor (tests and benchmarks inspect its runner)."""
        worker = getattr(self.executor, "driver_worker", None)
        if worker is None:
            raise AttributeError(f"the {self.config.parallel.executor_backend!r} executor has no in-process worker")
        return worker

    def add_request(self, request: EngineCoreRequest, max_tokens: int) -> None:
        self.check_awake()
        self.scheduler.add_request(request, max_tokens)

    def check_awake(self) -> None:
        if self.sleep_level:
            raise RuntimeError(f"the engine is asleep (level {self.sleep_level}): call wake_up() first")

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        outputs = self.scheduler.abort_requests(request_ids)
        self._report_finished(outputs)
        return outputs

    def _report_finished(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            if out.finish_reason is not None:
                self._hooks.keel_request_finished(request_id=out.request_id, reason=out.finish_reason)

    def shutdown(self) -> None:
        """Idempotent; tells plugins (keel_shutdown) once."""
        if not self._shut_down:
            self._shut_down = True
            self.executor.shutdown()
            for scheduler in self._schedulers:
                if scheduler.structured_output is not None:
                    scheduler.structured_output.shutdown()
            self._hooks.keel_shutdown()

    def check_health(self) -> None:
        """Raises if a worker is gone (`WorkerDiedError` naming the rank); called by the idle core loop
        between heartbeats."""
        self.executor.check_health()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute, apply. One forward pass.

        With async scheduling, the step launched by this call is applied by the next one: this call
        schedules and launches step N+1 first, then waits for step N and applies it, so the host's
        scheduling and input preparation overlap the device's work on step N.
        """
        if not self.async_scheduling:
            if not self.scheduler.has_unfinished_requests():
                return []
            scheduler_output = self.scheduler.schedule()
            return self._apply(scheduler_output, self.executor.execute_model(scheduler_output))
        launched = False
        depth = self.max_in_flight
        if len(self._in_flight) < depth and self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            pending = self.executor.execute_model_async(scheduler_output)
            if self.constrained_in_flight:  # the runner is in this process: its grammars advance as tokens land
                self.scheduler.launched(scheduler_output, pending.wait_sampled)
            self._in_flight.append((scheduler_output, pending))
            launched = not scheduler_output.is_empty
        if not self._in_flight or (launched and len(self._in_flight) < depth):
            return []  # early in a burst: launch more steps before waiting for the oldest
        scheduler_output, pending = self._in_flight.popleft()
        return self._apply(scheduler_output, pending.get_output())

    def drain(self) -> list[EngineCoreOutput]:
        """Wait for every launched step and apply it. With async scheduling the last step of a burst is
        often launched for requests whose final token the step before produced; once the front end has
        seen them finish, that step still holds the device. `sleep` calls this first."""
        outputs: list[EngineCoreOutput] = []
        while self._in_flight:
            scheduler_output, pending = self._in_flight.popleft()
            outputs += self._apply(scheduler_output, pending.get_output())
        return outputs

    def _apply(self, scheduler_output, runner_output) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._report_finished(outputs)
        return outputs

    # -- LLM.reset_prefix_cache / sleep / wake_up ---------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing done) while a request holds blocks."""
        return self.scheduler.kv.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and the weights too (level 2) on every rank; the cached prefixes are
        forgotten. Only between requests."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (free the KV cache) or 2 (also the weights), got {level!r}")
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError("cannot sleep while requests are unfinished: wait for them or abort them first")
        self.drain()
        if not self.reset_prefix_cache():
            raise RuntimeError("cannot sleep: KV blocks are still held")
        self.executor.collective_rpc("sleep", (level,))
        self.sleep_level = level

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what `sleep` freed: `tags` from "weights", "kv_cache" (None: both; weights first)."""
        tags = list(WAKE_UP_TAGS if tags is None else tags)
        unknown = [t for t in tags if t not in WAKE_UP_TAGS]
        if unknown:
            raise ValueError(f"unknown wake_up tag(s) {unknown}: use {list(WAKE_UP_TAGS)}")
        self.executor.collective_rpc("wake_up", (tuple(t for t in WAKE_UP_TAGS if t in tags),))
        if "kv_cache" in tags:
            self.sleep_level = 0

    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()
