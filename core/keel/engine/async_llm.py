"""`AsyncLLM`: the asyncio front end of the engine, as vLLM v1's (`vllm.v1.engine.async_llm.AsyncLLM`).

    engine = AsyncLLM.from_engine_args(EngineArgs(model="demo"))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-0"):
        print(out.outputs[0].text, end="")

It owns the API-process half of the engine: tokenization (on a dedicated thread), validation, the
output processor (detokenization, stop strings) and request statistics. The engine core sits behind an
`EngineCoreClient` (a background thread by default), so neither HTTP work nor detokenization ever runs
on the engine loop, and the core can later move to its own process.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from keel.config import EngineArgs, EngineConfig
from keel.gc_heap import freeze_startup_heap
from keel.engine.engine_client import EngineCoreClient, EngineDeadError, ThreadedEngineCoreClient
from keel.engine.llm_engine import POOLING_ONLY, _eos_token_id, load_tokenizer, resolve_model_shortcut
from keel.engine.output_processor import OutputProcessor, RequestOutputKind
from keel.engine.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from keel.engine.pooling_params import PoolingParams
from keel.engine.processor import Processor, child_request_id
from keel.engine.sampling_params import SamplingParams
from keel.logits_processor import resolve_logits_processors
from keel.metrics.stats import RequestStatsTracker, StatLogger
from keel.structured_output.manager import loaded, select_backend

logger = logging.getLogger("keel.engine")
request_logger = logging.getLogger("keel.requests")

# Outputs detokenized between two yields to the event loop, so a large batch never stalls HTTP work.
OUTPUT_CHUNK_SIZE = 64


class RequestOutputCollector:
    """The hand-off between the output loop and one `generate` consumer.

    `put` never blocks: if the consumer is behind, pending outputs are merged (`RequestOutput.add`,
    appending deltas), so a slow client costs memory proportional to its text, not to its steps.
    """

    def __init__(self, kind: RequestOutputKind) -> None:
        self.aggregate = kind is RequestOutputKind.DELTA
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(self._item, RequestOutput) and isinstance(item, RequestOutput):
            self._item.add(item, aggregate=self.aggregate)
        else:
            self._item = item
        self._ready.set()

    async def get(self) -> RequestOutput:
        while self._item is None:
            await self._ready.wait()
        item, self._item = self._item, None
        self._ready.clear()
        if isinstance(item, BaseException):
            raise item
        return item


class AsyncLLM:
    """Implements `keel.engine.engine_client.EngineClient` for the API server.

    All public coroutines run on one event loop (the one of the first `add_request`); `add_request`
    validates before queuing, and a consumer leaving `generate` early (client disconnect, cancellation)
    aborts its request at once. `abort` may come from any thread or task: it ends the request's
    `generate` with a final output whose unfinished completions have finish_reason "abort" (vLLM's
    behaviour). A dead or hung engine core (see `EngineCoreClient.check_health`) fails every pending
    request with EngineDeadError, leaves no per-request state behind, and fails every later one.
    """

    def __init__(self, config: EngineConfig, *, core_client: EngineCoreClient | None = None,
                 stat_loggers: Iterable[StatLogger] = (), log_requests: bool = False) -> None:
        self.config = config
        self.log_requests = log_requests  # each request's prompt and params at INFO on "keel.requests"
        if log_requests:
            request_logger.setLevel(logging.INFO)
        self.tokenizer = load_tokenizer(config)
        hf_config = config.model.hf_config
        self._max_model_len = config.model.derived_max_model_len
        if core_client is None and config.parallel.engine_core_process:
            from keel.engine.process_client import ProcessEngineCoreClient

            core_client = ProcessEngineCoreClient(config)
            self._max_model_len = core_client.max_model_len
        elif core_client is None:
            from keel.engine.core import EngineCore

            core = EngineCore(config)
            self._max_model_len = core.max_model_len
            core_client = ThreadedEngineCoreClient(core, config.parallel.engine_iteration_timeout_s)
        self.core_client = core_client
        self.processor = Processor(
            self.tokenizer, max_model_len=self._max_model_len, vocab_size=hf_config.vocab_size,
            eos_token_id=_eos_token_id(self.tokenizer, hf_config), seed=config.model.seed,
            generation_config=config.model.generation_config_fields, max_logprobs=config.model.max_logprobs,
            structured_output_backend=loaded(select_backend(config.plugin_set())),
            scheduling_policy=config.scheduler.scheduling_policy,
            logits_processors=resolve_logits_processors(config.model.logits_processors, config.plugin_set()),
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers: list[StatLogger] = list(stat_loggers)
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keel-tokenizer")
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._pooling: dict[str, list[int]] = {}  # pooling request id -> prompt token ids
        from keel.models.registry import is_pooling_model

        self.is_pooling_model = is_pooling_model(config)
        self._request_stats = RequestStatsTracker()
        self._last_stats: Any = None
        self._output_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: EngineDeadError | None = None
        freeze_startup_heap()  # the front end's heap too: tokenizer, server, plugins (see keel.gc_heap)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        """`AsyncEngineArgs` also set request logging (off) and the periodic stats line (on), as vLLM's."""
        from keel.engine_args import AsyncEngineArgs

        resolve_model_shortcut(args)
        config = args.create_engine_config()
        if isinstance(args, AsyncEngineArgs):
            kwargs.setdefault("log_requests", bool(args.enable_log_requests))
            if not args.disable_log_stats:
                logging_logger = config.plugin_set().registry("stat_logger").get("logging")
                kwargs["stat_loggers"] = [*kwargs.get("stat_loggers", ()), logging_logger()]
        return cls(config, **kwargs)

    # -- EngineClient ----------------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        self.stat_loggers.append(stat_logger)

    async def run_in_tokenizer_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, functools.partial(fn, *args))

    async def add_request(
        self, request_id: str, prompt: str | Mapping[str, Any] | list[int], params: SamplingParams,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA, priority: int = 0,
    ) -> RequestOutputCollector:
        """Tokenize, validate and queue; returns the collector `generate` reads from. `priority` orders
        requests under the "priority" scheduling policy (lower first); elsewhere it must be 0.

        Raises ValueError (PromptTooLongError for prompts over max_model_len) with nothing queued, or
        EngineDeadError.
        """
        self._loop = asyncio.get_running_loop()
        self._check_alive()
        if self.is_pooling_model:
            raise ValueError(POOLING_ONLY)
        self._check_id(request_id)
        processed = await self.run_in_tokenizer_thread(self.processor.process_prompt, prompt)
        if self.log_requests:
            request_logger.info("Received request %s: prompt: %r, params: %r, prompt_token_ids: %s", request_id,
                                processed.prompt, params, processed.prompt_token_ids)
        max_tokens = self.processor.max_tokens(params, len(processed.prompt_token_ids))
        core_requests = self.processor.make_requests(request_id, processed, params, time.monotonic(), priority)
        self._check_alive()
        self._check_id(request_id)  # again: another request may have taken the id while we tokenized
        collector = RequestOutputCollector(output_kind)
        child_ids = [r.request_id for r in core_requests]
        self.output_processor.add_request(request_id, child_ids, processed, params, output_kind, time.time())
        self._collectors[request_id] = collector
        self._request_stats.add(child_ids, time.monotonic(), num_prompt_tokens=len(processed.prompt_token_ids),
                                max_tokens=params.max_tokens)
        self._ensure_output_loop()
        try:
            for r in core_requests:
                self.core_client.add_request(r, max_tokens)
        except EngineDeadError as exc:  # the core went away meanwhile: forget everything of the engine
            self._fail(exc)
            raise
        return collector

    async def generate(
        self, prompt: str | Mapping[str, Any] | list[int], sampling_params: SamplingParams, request_id: str,
        *, output_kind: RequestOutputKind = RequestOutputKind.DELTA, priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs until the finished one; leaving early aborts the request."""
        collector = await self.add_request(request_id, prompt, sampling_params, output_kind, priority)
        async for out in self.iterate(request_id, collector):
            yield out

    async def encode(
        self, prompt: str | Mapping[str, Any] | list[int], pooling_params: PoolingParams, request_id: str,
        *, priority: int = 0,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Pool one prompt (vLLM's `AsyncLLM.encode`): yields its single, final PoolingRequestOutput.
        ValueError, nothing queued, on a model without a pooler or a bad prompt."""
        self._loop = asyncio.get_running_loop()
        self._check_alive()
        if not self.is_pooling_model:
            raise ValueError("this model does not support pooling (embeddings): serve an embedding model")
        self._check_id(request_id)
        processed = await self.run_in_tokenizer_thread(self.processor.process_prompt, prompt)
        core_request = self.processor.make_pooling_request(request_id, processed, pooling_params, time.monotonic(),
                                                           priority)
        self._check_alive()
        self._check_id(request_id)
        collector = RequestOutputCollector(RequestOutputKind.FINAL_ONLY)
        self._collectors[request_id] = collector
        self._pooling[request_id] = processed.prompt_token_ids
        self._request_stats.add([request_id], time.monotonic(), num_prompt_tokens=len(processed.prompt_token_ids))
        self._ensure_output_loop()
        try:
            self.core_client.add_request(core_request, 1)
        except EngineDeadError as exc:
            self._fail(exc)
            raise
        async for out in self.iterate(request_id, collector):
            yield out  # type: ignore[misc]

    def _deliver_pooled(self, outputs: list[Any], now: float) -> None:
        """The engine's results for pooling requests (each finishes with its one vector)."""
        import torch

        for eco in outputs:
            prompt_ids = self._pooling.pop(eco.request_id, None)
            collector = self._collectors.pop(eco.request_id, None)
            if prompt_ids is None:
                continue
            self._request_stats.finish(eco.request_id, str(eco.finish_reason), now)
            if collector is None or eco.pooling_output is None:
                continue  # aborted
            data = torch.tensor(eco.pooling_output, dtype=torch.float32)
            collector.put(PoolingRequestOutput(eco.request_id, PoolingOutput(data), prompt_ids, True,  # type: ignore[arg-type]
                                               num_cached_tokens=eco.num_cached_tokens))

    async def iterate(self, request_id: str,
                      collector: RequestOutputCollector) -> AsyncGenerator[RequestOutput, None]:
        """Drain a collector from `add_request`; closing or cancelling this generator early aborts."""
        finished = False
        try:
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort_now(request_id)

    async def abort(self, request_id: str) -> None:
        self.abort_now(request_id)

    def abort_now(self, request_id: str) -> None:
        """Abort without awaiting (usable from `finally` blocks and from any thread); unknown or
        finished ids are ignored. Its `generate` gets the final "abort" output and ends."""
        loop = self._loop
        if loop is not None and not _running_on(loop):
            try:
                loop.call_soon_threadsafe(self.abort_now, request_id)
            except RuntimeError:  # that loop is closed: nothing of it is left to end
                pass
            return
        child_ids, final = self.output_processor.abort_request(request_id)
        if self._pooling.pop(request_id, None) is not None:
            child_ids = [request_id]
        collector = self._collectors.pop(request_id, None)
        now = time.monotonic()
        for cid in child_ids:
            self._request_stats.finish(cid, "abort", now)
        if collector is not None and final is not None:
            collector.put(final)
        if child_ids and self._dead is None:
            try:
                self.core_client.abort_requests(child_ids)
            except EngineDeadError as exc:
                self._fail(exc)
                return
            logger.debug("aborted request %s", request_id)

    async def check_health(self) -> None:
        self._check_alive()

    def get_metrics(self) -> dict[str, Any]:
        """The latest engine-core counters (same keys as `LLMEngine.get_metrics`)."""
        s = self._last_stats
        if s is None:
            from keel.engine.core_output import SchedulerStats

            s = SchedulerStats()
        return {**s.as_metrics(), "num_unfinished_requests": len(self._collectors)}

    def shutdown(self) -> None:
        if self._output_task is not None and not self._output_task.done():
            self._output_task.cancel()
        self.core_client.shutdown()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # -- internals -------------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._dead is None:
            try:
                self.core_client.check_health()
            except EngineDeadError as exc:
                self._fail(exc)
        if self._dead is not None:
            raise self._dead

    def _check_id(self, request_id: str) -> None:
        if request_id in self._collectors or request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")

    def _ensure_output_loop(self) -> None:
        if self._output_task is None or self._output_task.done():
            self._output_task = asyncio.get_running_loop().create_task(self._output_loop())

    async def _output_loop(self) -> None:
        while True:
            batch = await self.core_client.get_output_async()
            if batch.error is not None:
                self._fail(EngineDeadError(batch.error))
                return
            now = time.monotonic()
            self._request_stats.observe_outputs(batch.outputs, now)
            outputs = batch.outputs
            if self._pooling:
                self._deliver_pooled([o for o in outputs if o.request_id in self._pooling], now)
            for start in range(0, len(outputs), OUTPUT_CHUNK_SIZE):
                if start:
                    await asyncio.sleep(0)
                ready, stopped = self.output_processor.process_outputs(outputs[start:start + OUTPUT_CHUNK_SIZE])
                if stopped:
                    self.core_client.abort_requests(stopped)
                for out in ready:
                    self._deliver(out, now)
            if batch.scheduler_stats is not None:
                self._last_stats = batch.scheduler_stats
            iteration = self._request_stats.take()
            for stat_logger in self.stat_loggers:
                try:
                    stat_logger.record(batch.scheduler_stats, iteration)
                except Exception:  # a broken logger must not take serving down
                    logger.exception("stat logger %r failed", stat_logger)

    def _deliver(self, out: RequestOutput, now: float) -> None:
        collector = self._collectors.get(out.request_id)
        if out.finished:
            self._collectors.pop(out.request_id, None)
            n = len(out.outputs)
            longest = 0
            for c in out.outputs:
                cid = out.request_id if n == 1 else child_request_id(out.request_id, c.index)
                longest = max(longest, self._request_stats.finish(cid, str(c.finish_reason), now))
            self._request_stats.finish_parent(n, longest)
        if collector is not None:
            collector.put(out)

    def _fail(self, error: EngineDeadError) -> None:
        """The engine is gone: every pending request gets `error`; no per-request state stays behind."""
        if self._dead is not None:
            return
        self._dead = error
        logger.error("%s", error)
        for collector in self._collectors.values():
            collector.put(error)
        self._collectors.clear()
        now = time.monotonic()
        for request_id in list(self.output_processor.parents):
            for cid in self.output_processor.abort_request(request_id)[0]:
                self._request_stats.finish(cid, "abort", now)
        for request_id in self._pooling:
            self._request_stats.finish(request_id, "abort", now)
        self._pooling.clear()


def _running_on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:  # no loop runs in this thread
        return False
