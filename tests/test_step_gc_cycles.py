"""A decode step of the engine loop leaves no reference cycles: what it makes is freed by reference counting.

LLMEngine.step over EngineCore with async scheduling and the in-process runner (the path of
benchmarks/h200_bitmask.py): plain requests (greedy, random sampling with logprobs) and, with the xgrammar
plugin, a JSON-constrained one, whose bitmask is filled on the manager's thread and whose sampling here
waits for it every step (`SampledLaunch.pending`, as on a GPU; on the CPU the fill is mostly done at
launch), its pending sampling never holding the launch that holds it. Every per-step object -- scheduler
output, GrammarBitmask, the fill and advance futures, AsyncModelRunnerOutput, SampledLaunch and its
threading.Event, ModelRunnerOutput, engine-core and request outputs -- must die by reference count: one
left in a cycle is freed only by the cyclic collector, and each collection holds the GIL for every thread
(on an H200, 0.1-1 ms a young collection, 8-30 ms a full one, in the middle of a ~10 ms decode step).

The bound held is exact: 0 objects found by `gc.collect()` after the warm-up and STEPS more steps with
the collector off -- a request finishing and one arriving within them included -- so a single
per-step cycle fails the test (STEPS of them would be STEPS or more objects). The objects it found are
named in the failure. The paths only a GPU runs (CUDA events, pinned copies, graph replay, Triton launches,
the compiled sampler noise) are measured by benchmarks/gc_per_step.py.
"""

from __future__ import annotations

import gc
import types
from collections import Counter

import pytest

from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.engine.output_processor import RequestOutputKind
from keel.engine.sampling_params import SamplingParams
from keel.testing.cycles import cyclic_garbage
from keel.testing.tokenizer import make_tiny_model
from keel.worker.async_output import SampledLaunch
from keel.worker.grammar_constraint import GrammarConstraint

WARM_UP, STEPS = 12, 40
# A string of at least 200 characters: the constrained request cannot finish within the steps measured.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "minLength": 200, "maxLength": 400}},
          "required": ["name"]}
LONG = 120  # more tokens than the warm-up and the measured steps: these requests decode throughout


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("gc-cycles"))
    eng = LLMEngine.from_engine_args(EngineArgs(model=str(path), platform="cpu", dtype="float32", block_size=8,
                                                max_model_len=256, seed=0, async_scheduling=True, max_num_seqs=8))
    yield eng
    eng.shutdown()


def add(engine, rid: str, params: SamplingParams, prompt: list[int]) -> None:
    engine.add_request(rid, {"prompt_token_ids": prompt}, params, RequestOutputKind.DELTA)


def run_steps(engine, steps: int, between) -> tuple[int, Counter, Counter]:
    """(objects left in cycles, their types, tokens each request got) by `steps` engine steps, the
    collector off; `between(i)` runs before step i (requests arriving)."""
    tokens: Counter = Counter()

    def work() -> None:
        for i in range(steps):
            between(i)
            for out in engine.step():
                tokens[out.request_id] += len(out.outputs[0].token_ids)
    found, kinds = cyclic_garbage(work)
    return found, kinds, tokens


def run_mix(engine, tag: str, constrained: SamplingParams | None) -> None:
    assert engine.core.async_scheduling
    plain = [SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=3, max_tokens=LONG, ignore_eos=True, logprobs=2),
             SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=WARM_UP + STEPS // 2, ignore_eos=True)]
    for i, params in enumerate(plain):
        add(engine, f"{tag}{i}", params, [5, 6, 7, 8 + i])
    if constrained is not None:
        add(engine, f"{tag}json", constrained, [9, 10, 11])
    for _ in range(WARM_UP):  # prefill, the grammar's compile, the first decode steps
        engine.step()
    late = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    found, kinds, tokens = run_steps(
        engine, STEPS, lambda i: add(engine, f"{tag}late", late, [12, 13, 14]) if i == STEPS // 4 else None)
    assert found == 0, f"{found} objects in reference cycles after {STEPS} steps: {kinds.most_common(12)}"
    # The steps did decode: every long request advanced each step, the short one finished, the late one ran.
    expected = [f"{tag}0", f"{tag}1"] + ([f"{tag}json"] if constrained is not None else [])
    assert all(tokens[rid] >= STEPS - 2 for rid in expected), tokens
    assert f"{tag}2" not in engine.core.scheduler.requests and tokens[f"{tag}late"] == 8, tokens
    for rid in expected:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def test_plain_decode_steps_leave_no_reference_cycles(engine):
    run_mix(engine, "p", None)


def reaches(source, target, depth: int = 8) -> bool:
    """Whether `target` is reachable from the function `source` through closures (functions, their cells and
    closure tuples, `depth` links at most; not through globals)."""
    frontier = [source]
    for _ in range(depth):
        frontier = [r for obj in frontier for r in gc.get_referents(obj)
                    if isinstance(r, (types.FunctionType, types.CellType, tuple)) or r is target]
        if any(r is target for r in frontier):
            return True
    return False


def test_constrained_decode_steps_leave_no_reference_cycles(engine, monkeypatch):
    pytest.importorskip("xgrammar")
    pytest.importorskip("keel_structured_output_xgrammar")
    assert engine.core.constrained_in_flight  # its grammar advances on the fill thread as tokens land
    # Every constrained step's sampling pends until its bitmask is read (as when the fill runs behind a
    # GPU's forward): `SampledLaunch.pending` holds it from the launch to the next step's start.
    monkeypatch.setattr(GrammarConstraint, "ready", property(lambda self: False))
    pended: list[bool] = []  # per pending launch: whether its pending sampling holds it (a cycle)
    finish = SampledLaunch.finish

    def spy(launch) -> None:
        if launch.pending is not None:
            pended.append(reaches(launch.pending, launch))
        finish(launch)
    monkeypatch.setattr(SampledLaunch, "finish", spy)
    run_mix(engine, "c", SamplingParams(temperature=1.0, max_tokens=LONG, ignore_eos=True,
                                       structured_outputs={"json": SCHEMA}))
    assert len(pended) >= STEPS and not any(pended), pended
