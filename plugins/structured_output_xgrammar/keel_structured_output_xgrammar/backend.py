"""The xgrammar backend: constraints -> xgrammar grammars -> per-request matchers.

`validate` parses the constraint into an xgrammar `Grammar` (no tokenizer needed, milliseconds), so a
malformed schema, regex or grammar is refused before queuing with xgrammar's own message. `compile`
builds the token-level automaton against the model's vocabulary (the expensive part; the core runs it
off the engine loop and caches it).
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Sequence

import torch
import tvm_ffi
import xgrammar as xgr

from keel.structured_output.backend import BackendContext
from keel.structured_output.manager import clean_error
from keel.structured_output.params import StructuredOutputsParams


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF accepting exactly one of `choices` (JSON string escapes are valid EBNF literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    if params.whitespace_pattern is not None:
        raise ValueError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend; "
                         "use disable_any_whitespace")
    kind = params.kind
    if kind in ("json", "json_object"):
        # json_object: any JSON object (OpenAI's JSON mode), with the same whitespace option.
        schema = params.schema_text if kind == "json" else '{"type": "object"}'
        # strict_mode (xgrammar's default, which vLLM keeps): no properties or items a schema does not
        # name, so disable_additional_properties is already in force.
        return xgr.Grammar.from_json_schema(schema, any_whitespace=not params.disable_any_whitespace,
                                            strict_mode=True)
    for option in ("disable_any_whitespace", "disable_additional_properties"):
        if getattr(params, option):
            raise ValueError(f"structured_outputs.{option} applies to json / json_object only, not {kind}")
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_grammar(params.choice))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(params.grammar)
    raise ValueError(f"structured_outputs.{kind} is not supported by the xgrammar backend")


class XGrammarMatcher:
    """keel.structured_output.backend.StructuredOutputGrammar over an xgrammar GrammarMatcher.

    Whether the grammar ended is kept here, not asked of the matcher: every call into xgrammar releases
    the GIL, and taking it back while the engine loop runs Python waits out a switch interval, so the
    fill thread's 256 `is_terminated()` calls per step cost ~10 ms at batch 256 against 0.2 ms alone.
    xgrammar terminates exactly when it accepts a stop token, and a rollback past it undoes that."""

    def __init__(self, matcher: xgr.GrammarMatcher, stop_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.handle = matcher._handle  # what the batch calls take: read once, not per step
        self.stop_token_ids = stop_token_ids
        self.terminated = False

    def accepted(self, token: int) -> None:
        """Record an accepted token (the batch accept calls the library itself)."""
        if token in self.stop_token_ids:
            self.terminated = True

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        for i, token in enumerate(tokens):
            if self.terminated or not self.matcher.accept_token(int(token)):
                if i:
                    self.rollback(i)
                return False
            self.accepted(int(token))
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> list[int]:
        accepted, terminated = 0, self.terminated
        for token in tokens:
            if self.terminated or not self.matcher.accept_token(int(token)):
                break
            self.accepted(int(token))
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        self.terminated = terminated
        return list(tokens[:accepted])

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.terminated = False  # a stop token is always the last one accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.terminated


class XGrammarBackend:
    """Registered as `structured_output` "xgrammar"; see keel.structured_output.backend for the calls."""

    def __init__(self, ctx: BackendContext) -> None:
        stop = [ctx.eos_token_id] if ctx.eos_token_id is not None else None
        self.info = xgr.TokenizerInfo.from_huggingface(ctx.tokenizer, vocab_size=ctx.vocab_size,
                                                       stop_token_ids=stop)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.batch = batch_matcher()

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        try:
            _grammar(params)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 -- xgrammar raises RuntimeError for every parse error
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {clean_error(exc)}") from None

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        return self.compiler.compile_grammar(_grammar(params))

    def grammar(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled), frozenset(compiled.tokenizer_info.stop_token_ids))

    def fill_bitmasks(self, grammars: Sequence[XGrammarMatcher], bitmask: torch.Tensor,
                      rows: Sequence[int] | None) -> None:
        """One call for a step's rows: xgrammar fills them on its own threads, without the GIL."""
        if grammars:
            handles = list(map(_HANDLE, grammars))
            self.batch._handle.batch_fill_next_token_bitmask(handles, bitmask, None if rows is None else list(rows),
                                                             False)

    def accept_tokens_batch(self, grammars: Sequence[XGrammarMatcher], tokens: Sequence[int]) -> list[bool]:
        """One token per grammar in one call (xgrammar's batch accept, in C++, GIL released); a refused
        token leaves its grammar unchanged. `tokens` are ints."""
        if not grammars:
            return []
        result = _BATCH_ACCEPT(list(map(_HANDLE, grammars)), tokens, False)
        if not _ARRAY_CONTAINS(result, 0):  # all accepted (the usual case): no element reads
            accepted = [True] * len(grammars)
        else:
            accepted = [_ARRAY_GET(result, i) != 0 for i in range(_ARRAY_SIZE(result))]
        if any(map(operator.contains, map(_STOP_TOKENS, grammars), tokens)):  # grammar.accepted(token), for
            # those that took a stop token: C-level loops, as this runs under the GIL on the fill thread
            for grammar, token, ok in zip(grammars, tokens, accepted, strict=True):
                if ok and token in grammar.stop_token_ids:
                    grammar.terminated = True
        return accepted


# Every tvm-ffi call releases the GIL by default -- also an Array's size and element reads, two per
# element. Reading the batch accept's result element by element made the fill thread take the GIL back
# 2 x 256 times a step; with the engine loop running, each is a handoff between the two threads that the
# loop pays for. These copies of the accessors keep the GIL (they take nanoseconds); the library's own
# are left as they are. The batch calls themselves release it (their C++ takes 0.1-5 ms).
_ARRAY_SIZE = tvm_ffi.get_global_func("ffi.ArraySize")
_ARRAY_GET = tvm_ffi.get_global_func("ffi.ArrayGetItem")
_ARRAY_CONTAINS = tvm_ffi.get_global_func("ffi.ArrayContains")
for _accessor in (_ARRAY_SIZE, _ARRAY_GET, _ARRAY_CONTAINS):
    _accessor.release_gil = False
_BATCH_ACCEPT = xgr.base._core.BatchGrammarMatcher.batch_accept_token  # the public wrapper reads each element
_HANDLE = operator.attrgetter("handle")
_STOP_TOKENS = operator.attrgetter("stop_token_ids")


def physical_cores() -> int | None:
    """Physical cores among the CPUs this process may run on (Linux topology); None where unknown."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:
        return None
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(topology + "physical_package_id") as pkg, open(topology + "core_id") as core:
                cores.add((pkg.read().strip(), core.read().strip()))
        except OSError:
            return None
    return len(cores)


def fill_threads() -> int:
    """xgrammar's batch fill threads: at most 8 and half the CPUs (vLLM fills on half the cores too), and
    two physical cores left to the engine loop and the model runner. One thread needs ~5 us per JSON
    matcher between values and 100-200 us inside a string (128k-token vocabulary), so at batch 256 one
    thread costs several decode steps. On the H200 host (16 CPUs) 12 threads filled no faster than 8,
    while the engine loop's Python ran 1.4-3x slower during the fill: as if it shared a core with the
    fill threads (the next measurement says: `h200_bitmask.py` records the topology)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, min(8, cpus // 2, (physical_cores() or cpus) - 2))


FILL_THREADS = fill_threads()


def batch_matcher() -> xgr.BatchGrammarMatcher:
    return xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
