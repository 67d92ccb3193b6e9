"""The engine core's side of structured outputs: compiling off the loop, one bitmask per step.

`StructuredOutputManager` is owned by the scheduler. `add_request` starts (or reuses) the compile of the
request's constraint on a worker thread -- compiles are cached by `StructuredOutputsParams.cache_key()`,
so n > 1 children and repeated schemas compile once. The scheduler leaves a waiting request in the queue
until `StructuredOutputRequest.is_ready()`, fills the bitmask of the constrained requests that sample in
a step (`grammar_bitmask`) and advances their grammars with the tokens it commits.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
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
_LIBRARY_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


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


@dataclass
class GrammarBitmask:
    """One step's constraint for the runner (a field of SchedulerOutput): row i of `bitmask` holds the
    tokens `req_ids[i]` may sample at one of its sampling rows this step. A request with k drafts has
    k + 1 consecutive rows, one per verify position, in order (the position after each draft)."""

    req_ids: list[str]
    bitmask: torch.Tensor  # [len(req_ids), ceil(vocab / 32)] int32, CPU


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
                 load_context: Callable[[], BackendContext], vocab_size: int) -> None:
        self._load_backend = load_backend  # called once, on the compile thread
        self.vocab_size = vocab_size
        self._load_context = load_context  # loads the tokenizer: called once, on the compile thread
        self._backend: StructuredOutputBackend | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keel-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()

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

    def grammar_bitmask(self, req_ids: Sequence[str], grammars: Sequence[StructuredOutputGrammar],
                        drafts: Sequence[Sequence[int]] | None = None) -> GrammarBitmask:
        """The allowed tokens of each request's next token, for a step in which they all sample; with
        `drafts` (already `validate_tokens`-checked) also those after each draft, the grammar advanced
        through the drafts tentatively and rolled back. A row past the grammar's end allows everything:
        verification stops at the end token, so nothing sampled there is kept."""
        drafts = drafts if drafts is not None else [()] * len(grammars)
        num_rows = sum(1 + len(d) for d in drafts)
        bitmask = torch.full((num_rows, bitmask_width(self.vocab_size)), -1, dtype=torch.int32)
        batch_fill = getattr(self._backend, "fill_bitmasks", None)
        if batch_fill is not None and num_rows == len(grammars):  # no drafts: every row at the current state
            live = [i for i, g in enumerate(grammars) if not g.is_terminated()]
            batch_fill([grammars[i] for i in live], bitmask, live)
            return GrammarBitmask(req_ids=list(req_ids), bitmask=bitmask)
        rows: list[str] = []
        for rid, grammar, tokens in zip(req_ids, grammars, drafts, strict=True):
            advanced, valid = 0, True
            for i in range(len(tokens) + 1):
                if valid and not grammar.is_terminated():
                    grammar.fill_bitmask(bitmask, len(rows))
                rows.append(rid)
                # A refused draft (not validated) ends what is known: verification stops at it anyway.
                valid = valid and i < len(tokens) and not grammar.is_terminated() and grammar.accept_tokens([tokens[i]])
                advanced += valid
            if advanced:
                grammar.rollback(advanced)
        return GrammarBitmask(req_ids=rows, bitmask=bitmask)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
