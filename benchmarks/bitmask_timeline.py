"""Where a constrained decode step's host time goes: instrumentation for benchmarks/h200_bitmask.py.

`StepTimeline.attach(engine)` wraps (on the instances, nothing in the library changes) the engine loop's
parts and the structured-output manager's fill, and records per step:

- main thread (the engine loop, holding the GIL while it runs Python): `schedule_ms`, `launch_ms`
  (execute_model_async: prepare inputs, launch the forward; waits first for the previous step's fill if
  its sampling is still pending), `tokens_wait_ms` (get_output: the previous step's tokens),
  `apply_ms` (update_from_output, of which `apply_grammar_ms` is the grammars' part: advancing them by
  the committed tokens, or reading the outcome when the fill thread did),
  `output_ms` (LLMEngine.step around the core step: output processing);
- the fill thread: `advance_ms` (the previous step's tokens on the host -> its grammars advanced by them),
  `landed_to_filled_ms` (those tokens on the host -> this step's bitmask filled: the chain that must fit
  in the forward), `start_after_launch_ms` (when the fill was started, from the launch of its step),
  `wake_ms` (started -> running on the fill thread: queued behind the previous step's advance, which
  waits for that step's tokens, and the wait for the GIL), `fill_job_ms` (the
  whole job), `fill_prep_ms` (the job's start -> the library's batch fill call: the buffer, the row
  lists), `batch_fill_ms` (the library's batch fill call inside it, GIL released; returning needs
  the GIL again), `fill_end_after_launch_ms`;
- the runner: `runner_wait_ms` (how long sampling waited for the bitmask) and
  `wait_begin_after_launch_ms`; and launch's parts (the runner in this process): `launch_update_states_ms`,
  `launch_prepare_inputs_ms`, `launch_stage_ms` (the one H2D copy), `launch_forward_ms` (the graph's
  static inputs and its replay, or the eager forward), `launch_logits_ms` (the LM head at the sampling
  rows), `launch_sampling_metadata_ms` and `launch_sampler_ms` (enqueueing the sampler's kernels) -- on a
  GPU each tensor op issued there is host time.

- the cyclic garbage collector, whichever thread it runs on (it holds the GIL, so every thread waits):
  `gc` gives each generation's collections during the recorded steps, their total and longest pause.

`summary()` gives the median of each over the recorded steps.

The wrappers hold no per-step object in a reference cycle (benchmarks/gc_per_step.py checks it with and
without them): in the runs up to 0b616fa the one around each step's get_output did, and their `gc`
figures were mostly the collector freeing those (~180 objects per step by gen-1 collections at batch 256).
"""

from __future__ import annotations

import bisect
import gc
import statistics
import time
from collections import Counter, defaultdict

from keel.testing.cycles import CollectionLog


def _now_ms() -> float:
    return time.perf_counter() * 1e3


class StepTimeline:
    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)
        self._marks: dict[int, dict[str, float]] = {}  # id(GrammarBitmask) -> timestamps (ms)
        self._restore: list = []
        self._plans: list = []
        self._events: list[tuple[str, float]] = []  # the fill thread's jobs, in order: (what, when in ms)
        self._spans: list[tuple[str, float, float]] = []  # every timed part: (name, begin, end) in ms
        self._gc = CollectionLog()

    def clear(self) -> None:
        self.samples.clear()
        self._marks.clear()
        self._plans.clear()
        self._events.clear()
        self._spans.clear()
        self._gc.runs.clear()

    def _add(self, name: str, value: float) -> None:
        self.samples[name].append(value)

    def _mark(self, plan, name: str) -> None:
        self._marks.setdefault(id(plan), {})[name] = _now_ms()

    def _wrap(self, obj, attr: str, make) -> None:
        original = getattr(obj, attr)
        setattr(obj, attr, make(original))
        # An instance's method is looked up on its class again at detach (`original` is a bound method:
        # stored back on the instance, it would hold the instance in a reference cycle).
        own = not isinstance(obj, type) and attr not in vars(obj)
        self._restore.append((obj, attr, None if own else original))

    @staticmethod
    def _timer(record):
        """A wrapper maker: each call's wall time (ms) goes to `record`."""
        def make(fn):
            def wrapped(*args, **kwargs):
                t = _now_ms()
                try:
                    return fn(*args, **kwargs)
                finally:
                    record(_now_ms() - t)
            return wrapped
        return make

    def _timed(self, name: str):
        def record(ms: float) -> None:
            end = _now_ms()
            self._add(name, ms)
            self._spans.append((name.removesuffix("_ms"), end - ms, end))
        return self._timer(record)

    def attach(self, engine) -> StepTimeline:
        from keel.structured_output.manager import GrammarBitmask

        core = engine.core
        scheduler, manager = core.scheduler, core.scheduler.structured_output
        self._wrap(scheduler, "schedule", self._timed("schedule_ms"))
        self._wrap(scheduler, "update_from_output", self._timed("apply_ms"))
        self._wrap_advance(scheduler)
        self._wrap_launch(core.executor)
        runner = getattr(getattr(core.executor, "driver_worker", None), "runner", None)
        if runner is not None:
            self._wrap_launch_parts(runner)
        self._wrap_output(engine)
        self._wrap_plans(manager)
        self._wrap_handle(GrammarBitmask)
        self._gc.attach()
        return self

    def _wrap_nested(self, outer, outer_attr: str, inner, inner_attr: str, report) -> None:
        """Time every `inner` call made during one `outer` call; `report(outer_ms, [inner_ms, ...])`."""
        inner_ms: list[float] = []

        def make_outer(fn):
            def wrapped(*args, **kwargs):
                inner_ms.clear()
                t = _now_ms()
                try:
                    return fn(*args, **kwargs)
                finally:
                    report(_now_ms() - t, list(inner_ms))
            return wrapped
        self._wrap(inner, inner_attr, self._timer(inner_ms.append))
        self._wrap(outer, outer_attr, make_outer)

    def _wrap_advance(self, scheduler) -> None:
        """apply_grammar_ms: the grammar work of one update_from_output, summed (the accepts, or reading the
        fill thread's outcome when it advanced them)."""
        def report(_, inner: list[float]) -> None:
            if inner:
                self._add("apply_grammar_ms", sum(inner))
        self._wrap_nested(scheduler, "update_from_output", scheduler, "_advance_grammar", report)

    def _wrap_launch(self, executor) -> None:
        from keel.worker.async_output import AsyncModelRunnerOutput

        def make(fn):
            def wrapped(scheduler_output):
                t = _now_ms()
                pending = fn(scheduler_output)
                end = _now_ms()
                self._add("launch_ms", end - t)
                self._spans.append(("launch", t, end))
                if scheduler_output.grammar_bitmask is not None:
                    self._marks.setdefault(id(scheduler_output.grammar_bitmask), {})["launch"] = end
                    self._plans.append(scheduler_output.grammar_bitmask)
                return pending
            return wrapped
        self._wrap(executor, "execute_model_async", make)

        def make_get_output(fn):
            # On the class, not on each step's output: a closure over `pending.get_output` stored on
            # `pending` held every step's output (its launch, tensors, event) in a reference cycle, so
            # the runs measured the cyclic collector freeing what the engine's own steps never leave.
            def timed_get_output(pending):
                t0 = _now_ms()
                try:
                    return fn(pending)
                finally:
                    self._add("tokens_wait_ms", _now_ms() - t0)
                    self._spans.append(("tokens_wait", t0, _now_ms()))
            return timed_get_output
        self._wrap(AsyncModelRunnerOutput, "get_output", make_get_output)

    def _wrap_launch_parts(self, runner) -> None:
        for name, (obj, attr) in {
            "launch_update_states_ms": (runner, "_update_states"),
            "launch_prepare_inputs_ms": (runner.input_batch, "prepare_inputs"),
            "launch_stage_ms": (runner.staging, "stage"),
            "launch_forward_ms": (runner, "_forward"),
            "launch_logits_ms": (runner.model, "compute_logits"),
            "launch_sampling_metadata_ms": (runner.sampling_state, "build"),
            "launch_sampler_ms": (runner.sampler, "forward"),
        }.items():
            self._wrap(obj, attr, self._timer(lambda ms, name=name: self._add(name, ms)))

    def _wrap_output(self, engine) -> None:
        """engine_step_ms, and output_ms: LLMEngine.step less the engine core's step in it."""
        def report(total: float, inner: list[float]) -> None:
            self._add("engine_step_ms", total)
            self._add("output_ms", total - sum(inner))
        self._wrap_nested(engine, "step", engine.core, "step", report)

    def _wrap_plans(self, manager) -> None:
        """Each planned bitmask's fill job, timed on the fill thread; the backend's batch fill inside it."""
        def make_plan(fn):
            def wrapped(*args, **kwargs):
                plan = fn(*args, **kwargs)
                fill = plan._fill
                key = id(plan)  # not `plan` itself: plan._fill would hold it in a reference cycle

                def timed_fill():
                    self._marks.setdefault(key, {})["fill_begin"] = _now_ms()
                    try:
                        return fill()
                    finally:
                        self._marks.setdefault(key, {})["fill_end"] = _now_ms()
                        self._events.append(("filled", _now_ms()))
                plan._fill = timed_fill
                return plan
            return wrapped
        self._wrap(manager, "plan_bitmask", make_plan)

        def make_advance(fn):
            def wrapped(req_ids, grammars, wait_sampled, *rest):
                def timed_wait(timeout):
                    tokens = wait_sampled(timeout)
                    if tokens is not None:
                        self._events.append(("landed", _now_ms()))
                    return tokens
                try:
                    return fn(req_ids, grammars, timed_wait, *rest)
                finally:
                    self._events.append(("advanced", _now_ms()))
            return wrapped
        if hasattr(manager, "_advance"):
            self._wrap(manager, "_advance", make_advance)
        backend = manager._get_backend()
        if hasattr(backend, "fill_bitmasks"):
            self._wrap(backend, "fill_bitmasks", self._timed("batch_fill_ms"))

    def _wrap_handle(self, cls) -> None:
        def make_start(fn):
            def wrapped(plan):
                if plan._fill is not None and plan._future is None:
                    self._mark(plan, "start")
                return fn(plan)
            return wrapped

        def make_result(fn):
            def wrapped(plan):
                if plan.done():
                    return fn(plan)
                self._mark(plan, "wait_begin")
                try:
                    return fn(plan)
                finally:
                    self._mark(plan, "wait_end")
            return wrapped
        self._wrap(cls, "start", make_start)
        self._wrap(cls, "result", make_result)

    def detach(self) -> None:
        self._gc.detach()
        for obj, attr, original in reversed(self._restore):
            if original is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, original)
        self._restore.clear()

    def summary(self) -> dict[str, float | None]:
        derived: dict[str, list[float]] = defaultdict(list)
        for plan in self._plans:
            m = self._marks.get(id(plan), {})
            launch = m.get("launch")
            if launch is None:
                continue
            if "start" in m:
                derived["start_after_launch_ms"].append(m["start"] - launch)
                if "fill_begin" in m:
                    derived["wake_ms"].append(m["fill_begin"] - m["start"])
            if "fill_begin" in m and "fill_end" in m:
                derived["fill_job_ms"].append(m["fill_end"] - m["fill_begin"])
                derived["fill_end_after_launch_ms"].append(m["fill_end"] - launch)
            wait = m.get("wait_end", 0.0) - m.get("wait_begin", 0.0)
            derived["runner_wait_ms"].append(wait)
            if "wait_begin" in m:
                derived["wait_begin_after_launch_ms"].append(m["wait_begin"] - launch)
        fill_starts = sorted(b for name, b, _ in self._spans if name == "batch_fill")
        for m in self._marks.values():  # the fill job's start -> its library batch fill's start
            if "fill_begin" in m:
                i = bisect.bisect_left(fill_starts, m["fill_begin"])
                if i < len(fill_starts) and ("fill_end" not in m or fill_starts[i] <= m["fill_end"]):
                    derived["fill_prep_ms"].append(fill_starts[i] - m["fill_begin"])
        landed = None
        for what, t in list(self._events):
            if what == "landed":
                landed = t
            elif what == "advanced" and landed is not None:
                derived["advance_ms"].append(t - landed)
            elif what == "filled" and landed is not None:  # the next step's fill, queued behind the advance
                derived["landed_to_filled_ms"].append(t - landed)
                landed = None
        out = {name: statistics.median(values) for name, values in {**self.samples, **derived}.items() if values}
        out["steps_with_bitmask"] = len(self._plans)
        steps = self.samples.get("engine_step_ms", [])
        # the step's spread: a few long steps move a run's mean (what the overhead compares) off its median
        out["engine_step_max_ms"] = max(steps, default=None)
        out["engine_steps_over_2x_median"] = sum(1 for v in steps if v > 2 * statistics.median(steps)) if steps else 0
        out["gc"] = {g: v for g, v in self._gc.by_generation().items() if v["count"]}
        # what a full collection walks: the objects the collector tracks outside the frozen startup heap
        tracked = gc.get_objects()
        out["gc"]["tracked"] = len(tracked)
        out["gc"]["frozen"] = gc.get_freeze_count()
        out["gc"]["tracked_by_type"] = dict(Counter(type(o).__qualname__ for o in tracked).most_common(15))
        out["gc"]["tracked_by_module"] = dict(Counter(type(o).__module__ for o in tracked).most_common(10))
        del tracked
        out["trace"] = self.trace()
        out["trace_slowest"] = self.trace(steps=3, slowest=True)
        return out

    def trace(self, steps: int = 4, slowest: bool = False) -> list:
        """Every timed part and fill-thread event of `steps` consecutive steps from the run's middle (or
        from the one before its longest launch-to-launch step, with `slowest`), as [name, begin, end] in
        ms from the window's start (an event has begin == end): which parts of the engine loop, the fill
        thread, the runner and the garbage collector overlap, step by step."""
        launches = sorted(t for name, t, _ in self._spans if name == "launch")
        if len(launches) < steps + 2:
            return []
        mid = len(launches) // 2
        if slowest:
            longest = max(range(len(launches) - 1), key=lambda i: launches[i + 1] - launches[i])
            mid = min(max(longest - 1, 0), len(launches) - steps - 1)
        lo, hi = launches[mid], launches[mid + steps]
        points = [(f"fill:{k}", t, t) for k, t in self._events]
        points += [(f"plan:{k}", t, t) for m in self._marks.values() for k, t in m.items()]
        spans = self._spans + [(f"gc{g}", b, e) for g, b, e, _ in self._gc.runs if g == 2 or e - b > 1.0]
        rows = [(n, b, e) for n, b, e in spans + points if e >= lo and b <= hi]
        return [[n, round(b - lo, 3), round(e - lo, 3)] for n, b, e in sorted(rows, key=lambda r: r[1])]
