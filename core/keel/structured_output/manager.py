"""The engine core's side of structured outputs: compiling off the loop, one bitmask per step.

`StructuredOutputManager` is owned by the scheduler. `add_request` starts (or reuses) the compile of the
request's constraint on a worker thread -- compiles are cached by `StructuredOutputsParams.cache_key()`,
so n > 1 children and repeated schemas compile once. The scheduler leaves a waiting request in the queue
until `StructuredOutputRequest.is_ready()`, plans the bitmask of the constrained requests that sample in
a step (`plan_bitmask`; filled on a second thread while the step's forward runs, see `GrammarBitmask`)
and advances their grammars with the tokens it commits.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from keel.structured_output.backend import (
    BackendContext,
    StructuredOutputBackend,
    StructuredOutputGrammar,
    bitmask_width,
)
from keel.structured_output.params import StructuredOutputsParams

logger = logging.getLogger("keel.structured_output")

# Distinct compiled constraints kept; a client cycling through schemas cannot grow memory without end.
MAX_CACHED_GRAMMARS = 512
# The longest the fill thread waits for the GIL while the engine loop runs Python (CPython's default is
# 5 ms: the fill thread needs the GIL when it wakes and when the library's fill returns, and a decode
# step is ~10 ms, so at the default a fill took 4 ms of work plus up to 10 ms of waiting). A waiting thread
# is what makes the holder switch, so without a fill in flight the lower interval costs nothing.
FILL_SWITCH_INTERVAL_S = 0.0002
# Bitmask buffers kept for reuse (see StructuredOutputManager._take_buffer): two steps are in flight.
MAX_FREE_BUFFERS = 4
_ACCEPTED = (True, False)  # an advance's outcome for a request: accepted, not ended
_LIBRARY_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


# Set when the interpreter starts to exit, before it joins worker threads (concurrent.futures registers its
# own join the same way): an advance waiting for a step that an engine dropped without shutdown never
# enqueues must not keep the process alive.
_exiting = threading.Event()
threading._register_atexit(_exiting.set)


def clean_error(exc: BaseException) -> str:
    """A library's error message without its source-location prefix ("[12:00:00] file.cc:12: ")."""
    return _LIBRARY_PREFIX.sub("", str(exc).strip()) or type(exc).__name__


def select_backend(plugins: Any) -> Callable[[], type[StructuredOutputBackend]] | None:
    """A loader of the `structured_output` backend class ("xgrammar" when registered, else the first
    one); None if no plugin provides the kind (constrained requests are then refused by the front end).
    The front end calls it at startup (a broken backend plugin stops startup, naming it); an engine core
    in its own process imports the class only when its first constrained request arrives."""
    registry = plugins.registry("structured_output")
    keys = registry.keys()
    if not keys:
        return None
    key = "xgrammar" if "xgrammar" in keys else keys[0]
    return lambda: registry.get(key)


def loaded(load: Callable[[], type] | None) -> Callable[[], type] | None:
    """`load`, after calling it once (the front end: import the backend at startup)."""
    if load is not None:
        load()
    return load


class GrammarBitmask:
    """One step's constraint for the runner (a field of SchedulerOutput): row i of the bitmask holds the
    tokens `req_ids[i]` may sample at one of its sampling rows this step. A request with k drafts has
    k + 1 consecutive rows, one per verify position, in order (the position after each draft).

    The scheduler decides the rows (`StructuredOutputManager.plan_bitmask`); the tensor is filled later,
    on the manager's fill thread, once every grammar has seen the tokens before this step (`start`: by
    the scheduler itself, or after it applied the step before). The model runner launches the step's
    forward first and waits (`result`) only right before sampling, so the fill overlaps the device.
    Pickling (a worker in another process) waits for the fill.
    """

    def __init__(self, req_ids: list[str], bitmask: torch.Tensor | None = None,
                 fill: Callable[[], torch.Tensor] | None = None, pool: ThreadPoolExecutor | None = None,
                 pinned: bool = False) -> None:
        self.req_ids = req_ids
        self.pinned = pinned  # the bitmask is in pinned memory: the runner copies it to the device directly
        self._bitmask = bitmask  # [len(req_ids), ceil(vocab / 32)] int32, CPU (pinned for a device runner)
        self._fill = fill  # allocates and fills the bitmask; None once filled
        self._pool = pool
        self._future: Future | None = None
        self._recycled = False  # its buffer went back to the manager (its step's tokens are on the host)
        self.grammars: list | None = None  # the rows' grammars (one row each, without drafts), when planned

    def start(self) -> None:
        """Begin the fill on the manager's thread (idempotent). Called by the scheduler."""
        if self._fill is not None and self._future is None:
            self._future = self._pool.submit(self._fill)

    def done(self) -> bool:
        """The bitmask is filled (`result` will not wait)."""
        return self._fill is None or (self._future is not None and self._future.done())

    def result(self) -> torch.Tensor:  # [rows, ceil(vocab / 32)] int32, CPU
        """The filled bitmask, waiting for the fill if needed. Called by the model runner before sampling."""
        if self._recycled:
            raise RuntimeError("a grammar bitmask was read after its step's tokens were on the host (its "
                               "buffer is reused by a later step)")
        if self._fill is not None:
            if self._future is None:
                raise RuntimeError("a grammar bitmask was read before its fill started (its step's grammars "
                                   "had not seen the previous step's tokens)")
            self._bitmask = self._future.result()
            self._fill = self._future = None
        return self._bitmask

    @property
    def bitmask(self) -> torch.Tensor:
        return self.result()

    def __getstate__(self) -> dict:
        return {"req_ids": self.req_ids, "_bitmask": self.result(), "_fill": None, "_pool": None, "_future": None,
                "_recycled": False, "pinned": False, "grammars": None}


class StructuredOutputRequest:
    """A request's constraint inside the core: the compile in flight, then its grammar (or the error)."""

    def __init__(self, compiled: Future, make_grammar: Callable[[Any], StructuredOutputGrammar]) -> None:
        self._compiled = compiled
        self._make_grammar = make_grammar
        self.grammar: StructuredOutputGrammar | None = None
        self.error: str | None = None

    def is_ready(self) -> bool:
        """True once compiled (then `grammar` or `error` is set). Called by the scheduler."""
        if self.grammar is not None or self.error is not None:
            return True
        if not self._compiled.done():
            return False
        try:
            self.grammar = self._make_grammar(self._compiled.result())
        except Exception as exc:  # noqa: BLE001 -- reported as this request's failure, not the loop's
            self.error = clean_error(exc)
        return True


class StructuredOutputManager:
    def __init__(self, load_backend: Callable[[], type[StructuredOutputBackend]],
                 load_context: Callable[[], BackendContext], vocab_size: int, pin_memory: bool = False) -> None:
        self._load_backend = load_backend  # called once, on the compile thread
        self.vocab_size = vocab_size
        # Bitmasks in pinned memory: the model runner in this process copies them without blocking.
        self.pin_memory = pin_memory
        # Fills run here, off the engine loop (the backend's batch fill releases the GIL), in step order.
        self._switch_interval = sys.getswitchinterval()  # restored at shutdown
        sys.setswitchinterval(min(self._switch_interval, FILL_SWITCH_INTERVAL_S))
        self._fill_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keel-grammar-fill")
        # Filled bitmasks whose step has sampled, for the next fills (deque: taken and returned from
        # either thread without a lock).
        self._free_buffers: deque[torch.Tensor] = deque(maxlen=MAX_FREE_BUFFERS)
        self.num_buffers_allocated = 0  # bitmask buffers made (the rest were reused): benchmarks read it
        self._load_context = load_context  # loads the tokenizer: called once, on the compile thread
        self._backend: StructuredOutputBackend | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keel-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def _get_backend(self) -> StructuredOutputBackend:
        if self._backend is None:
            self._backend = self._load_backend()(self._load_context())
        return self._backend

    def _compile(self, params: StructuredOutputsParams) -> Any:
        return self._get_backend().compile(params)

    def add_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """Called by `Scheduler.add_request`; never blocks on a compile."""
        key = params.cache_key()
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool.submit(self._compile, params)
                self._cache[key] = future
                if len(self._cache) > MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        return StructuredOutputRequest(future, lambda compiled: self._get_backend().grammar(compiled))

    def plan_bitmask(self, req_ids: Sequence[str], grammars: Sequence[StructuredOutputGrammar],
                     drafts: Sequence[Sequence[int]] | None = None) -> GrammarBitmask:
        """A step's bitmask, not filled yet: the allowed tokens of each request's next token, for a step in
        which they all sample; with `drafts` (already `validate_tokens`-checked) also those after each
        draft. Called by the scheduler; the fill runs on this manager's fill thread once started."""
        grammars = list(grammars)
        if drafts is None:  # one row each (every decode step without speculative decoding)
            rows = list(req_ids)
            fill = lambda: self._fill_rows(len(rows), grammars, None)
        else:
            drafts = list(drafts)
            rows = [rid for rid, tokens in zip(req_ids, drafts, strict=True) for _ in range(len(tokens) + 1)]
            fill = lambda: self._fill_rows(len(rows), grammars, drafts)
        plan = GrammarBitmask(rows, fill=fill, pool=self._fill_pool, pinned=self.pin_memory)
        plan.grammars = grammars if drafts is None else None
        return plan

    def plan_advance(self, req_ids: Sequence[str], grammars: Sequence[StructuredOutputGrammar],
                     wait_sampled: Callable[[float], dict[str, int] | None],
                     bitmask: GrammarBitmask | None = None) -> Future:
        """Advance `grammars` by the tokens their requests sample in a step just launched, on the fill
        thread, the moment those tokens are on the host (`wait_sampled(timeout)`: {req_id: token}, None
        while the step's sampling is not enqueued yet) -- before the next step's bitmask fill, which is
        queued behind it. Called by the scheduler right after the launch; the future's result is
        {req_id: (accepted, terminated after it)} for the requests advanced (a terminated grammar, or one
        whose request sampled nothing, is left alone), which `update_from_output` reads instead of advancing
        them itself. `bitmask`: the step's own, which its sampling has used once the tokens are on the
        host: its buffer then serves a later fill (reading it afterwards is an error)."""
        req_ids, grammars = list(req_ids), list(grammars)
        return self._fill_pool.submit(self._advance, req_ids, grammars, wait_sampled, bitmask)

    def _advance(self, req_ids: list[str], grammars: list[StructuredOutputGrammar],
                 wait_sampled: Callable[[float], dict[str, int] | None],
                 bitmask: GrammarBitmask | None = None) -> dict[str, tuple[bool, bool]]:
        tokens = None
        while tokens is None:  # the step's sampling is enqueued by the engine loop; stop waiting at shutdown
            if self._closed or _exiting.is_set():
                return {}
            tokens = wait_sampled(0.1)
        if bitmask is not None:
            self._recycle(bitmask)
        # Every request of the step sampled and none has ended (the usual case): no per-request filtering.
        # This runs under the GIL while the engine loop wants it, so it stays in C-level loops (map).
        if len(tokens) >= len(req_ids) and all(map(tokens.__contains__, req_ids)) and not any(
                g.is_terminated() for g in grammars):
            live_ids, live = req_ids, grammars
        else:
            pairs = [(rid, g) for rid, g in zip(req_ids, grammars, strict=True)
                     if rid in tokens and not g.is_terminated()]
            live_ids, live = [rid for rid, _ in pairs], [g for _, g in pairs]
        picked = list(map(tokens.__getitem__, live_ids))
        batch_accept = getattr(self._backend, "accept_tokens_batch", None)
        if batch_accept is not None:
            accepted = batch_accept(live, picked)
        else:
            accepted = [g.accept_tokens([t]) for g, t in zip(live, picked, strict=True)]
        # {req_id: (accepted, ended)}, built in C (one shared tuple) and corrected where a token was refused
        # or ended its grammar. Whether each ended is read here: the next step's advance may run before the
        # loop reads this.
        outcome = dict.fromkeys(live_ids, _ACCEPTED)
        if not all(accepted):
            outcome.update((rid, (False, False)) for rid, ok in zip(live_ids, accepted, strict=True) if not ok)
        outcome.update((rid, (True, True)) for rid, g in zip(live_ids, live, strict=True) if g.is_terminated())
        return outcome

    def grammar_bitmask(self, req_ids: Sequence[str], grammars: Sequence[StructuredOutputGrammar],
                        drafts: Sequence[Sequence[int]] | None = None) -> GrammarBitmask:
        """`plan_bitmask`, filled on the caller's thread (tests, benchmarks)."""
        planned = self.plan_bitmask(req_ids, grammars, drafts)
        return GrammarBitmask(planned.req_ids, planned._fill(), pinned=planned.pinned)

    def _fill_rows(self, num_rows: int, grammars: list[StructuredOutputGrammar],
                   drafts: list[Sequence[int]] | None) -> torch.Tensor:  # [num_rows, words] int32
        """With drafts, the grammar is advanced through them tentatively and rolled back. A row past the
        grammar's end allows everything: verification stops at the end token, so nothing sampled there is
        kept. Runs while no other thread touches these grammars (the scheduler advances them only once
        the step's tokens arrived, which needs this bitmask). Allocated here, off the engine loop; a fill
        writes whole rows, so only the rows nobody fills are set (to all allowed)."""
        bitmask = self._take_buffer(num_rows)
        batch_fill = getattr(self._backend, "fill_bitmasks", None)
        if drafts is None and batch_fill is not None:  # one row each
            if any(g.is_terminated() for g in grammars):
                active = [j for j, g in enumerate(grammars) if not g.is_terminated()]
                bitmask[sorted(set(range(num_rows)) - set(active))] = -1
                batch_fill([grammars[j] for j in active], bitmask, active)
            else:
                batch_fill(grammars, bitmask, None)
            return bitmask
        drafts = drafts if drafts is not None else [()] * len(grammars)
        batch_accept = getattr(self._backend, "accept_tokens_batch", None)
        if batch_fill is not None and (num_rows == len(grammars) or batch_accept is not None):
            self._fill_rows_batched(bitmask, grammars, drafts, batch_fill, batch_accept)
            return bitmask
        row = 0
        for grammar, tokens in zip(grammars, drafts, strict=True):
            advanced, valid = 0, True
            for i in range(len(tokens) + 1):
                if valid and not grammar.is_terminated():
                    grammar.fill_bitmask(bitmask, row)
                else:
                    bitmask[row] = -1
                row += 1
                # A refused draft (not validated) ends what is known: verification stops at it anyway.
                valid = valid and i < len(tokens) and not grammar.is_terminated() and grammar.accept_tokens([tokens[i]])
                advanced += valid
            if advanced:
                grammar.rollback(advanced)
        return bitmask

    def _take_buffer(self, num_rows: int) -> torch.Tensor:  # [num_rows, words] int32, contents garbage
        """A bitmask buffer: one whose step has sampled (`_recycle`), else a new one. A 4 MB pinned
        allocation per step (batch 256, 128k vocabulary) released the GIL once more -- each take-back costs
        the engine loop a handoff -- and sat in the 3.4 ms the fill thread spent on the H200 between its
        advance and the library's fill (fa4e9f7)."""
        while self._free_buffers:
            try:
                buffer = self._free_buffers.pop()
            except IndexError:  # taken by the other thread meanwhile
                break
            if buffer.shape[0] >= num_rows:
                return buffer[:num_rows]
        self.num_buffers_allocated += 1
        return torch.empty((num_rows, bitmask_width(self.vocab_size)), dtype=torch.int32, pin_memory=self.pin_memory)

    def _recycle(self, plan: GrammarBitmask) -> None:
        """`plan`'s step has sampled (its tokens are on the host): the runner's copy of its bitmask to the
        device is done, so the buffer may be filled again. A plan whose fill nobody read is left alone."""
        if plan._fill is not None or plan._bitmask is None or plan._recycled:
            return
        bitmask, plan._bitmask, plan._recycled = plan._bitmask, None, True
        self._free_buffers.append(bitmask if bitmask._base is None else bitmask._base)

    @staticmethod
    def _fill_rows_batched(bitmask: torch.Tensor, grammars: list[StructuredOutputGrammar],
                           drafts: list[Sequence[int]], batch_fill: Callable, batch_accept: Callable | None) -> None:
        """`_fill_rows` in one library call per verify position (the backend's batch fill, then its batch
        accept of that position's drafts) instead of one per row: each library call releases the GIL, and
        taking it back while the engine loop runs Python waits a switch interval. Only the rollbacks stay
        one per grammar."""
        starts, row = [], 0
        for tokens in drafts:
            starts.append(row)
            row += len(tokens) + 1
        filled: list[int] = []
        advanced = [0] * len(grammars)
        active = [j for j, g in enumerate(grammars) if not g.is_terminated()]
        for pos in range(max((len(t) for t in drafts), default=0) + 1):
            if not active:
                break
            rows = [starts[j] + pos for j in active]
            batch_fill([grammars[j] for j in active], bitmask, rows)
            filled += rows
            # A refused draft (not validated) ends what is known: verification stops at it anyway.
            step = [j for j in active if pos < len(drafts[j])]
            accepted = batch_accept([grammars[j] for j in step], [drafts[j][pos] for j in step]) if step else []
            active = []
            for j, ok in zip(step, accepted, strict=True):
                if ok:
                    advanced[j] += 1
                    if not grammars[j].is_terminated():  # past a draft that ended it, rows allow everything
                        active.append(j)
        if len(filled) < bitmask.shape[0]:
            bitmask[sorted(set(range(bitmask.shape[0])) - set(filled))] = -1
        for grammar, count in zip(grammars, advanced, strict=True):
            if count:
                grammar.rollback(count)

    def shutdown(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=False, cancel_futures=True)
        sys.setswitchinterval(self._switch_interval)
