"""What the structured-output fill thread takes from the engine loop per decode step: its time under the GIL.

    python benchmarks/bitmask_gil.py --vocab-file tok.json [--batch 256] [--steps 40] [--out x.json]
    python benchmarks/bitmask_gil.py --smoke [--out x.json]   # tiny vocabulary and batch: the script runs

CPU only (no device needed), so it runs on a laptop and on the GPU host alike. The engine loop runs Python
for most of a decode step; each ms the fill thread holds the GIL meanwhile is a ms the loop waits, and
each time the fill thread takes the GIL back after a library call released it costs the loop a forced
switch (and the fill thread a wait of up to a switch interval). Here the main thread plays the loop: a
Python workload in chunks of known cost (~20 us; dict and list work and two small torch calls, which
release the GIL as the loop's launches do), started the moment a step's tokens "land", while the
manager's fill thread does that step's work as in the engine -- advance `batch` grammars by the tokens
(`StructuredOutputManager.plan_advance`), then fill the next step's bitmask (`plan_bitmask`, queued behind
it). Per step (medians):

- `gil_takes`: how often the fill thread takes the GIL back from a busy loop (after each library call or
  wait that released it): with the loop in pure Python at a long switch interval (`TAKE_INTERVAL_S`)
  each take waits one interval, so the busy chain's excess over the idle one counts them. Each costs the loop a forced switch;
- `python_cpu_ms`: the fill thread's CPU time outside the library's batch accept and batch fill (its
  Python, under the GIL: what the loop cannot run meanwhile), `fill_thread_cpu_ms` with them (thread CPU
  clocks: robust to a loaded machine);
- `stolen_ms`: the loop's wall time while the fill ran less the same chunks alone, at the engine's
  switch interval -- what the loop lost, switches included (on a machine with fewer free cores than the
  library's fill threads, also their CPU: `host_cpus` says); `stolen_outside_fill_ms`, the part outside
  the library's batch fill (which computes on its own threads without the GIL);
- `chain_ms`: tokens landed -> next bitmask filled with the loop busy (it must fit in a forward),
  `chain_idle_ms` with the main thread waiting.

The grammars see the benchmark's vocabulary (h200_bitmask.tokenizer_info); each step every grammar
accepts a random allowed token of its last bitmask, and a grammar that ended starts over.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import h200_bitmask as hb  # the vocabulary, the schema and the engine's backend set-up

CHUNK_ITEMS = 60  # one chunk of the loop's stand-in workload: dict and list work, ~20 us
TAKE_INTERVAL_S = 0.002


_A, _B = torch.ones(16), torch.ones(16)


def _chunk(n: int = CHUNK_ITEMS) -> int:
    """Dict and list work, with two small torch calls (which release the GIL, as the loop's launches do)."""
    d = {}
    for i in range(n):
        d[f"r{i}"] = [i, i + 1]
    torch.add(_A, _B, out=_A)
    torch.mul(_A, 0.5, out=_A)
    return sum(v[0] for v in d.values())


def _python_chunk(n: int = CHUNK_ITEMS) -> int:
    """The chunk without the torch calls: the loop holds the GIL until forced to switch."""
    d = {}
    for i in range(n):
        d[f"r{i}"] = [i, i + 1]
    return sum(v[0] for v in d.values())


def _chunks_alone(chunk) -> float:
    """The median chunk time (us) with nothing else running."""
    return hb._median_ms(chunk, "cpu", iters=2000) * 1e3


def _pick_tokens(bitmask: torch.Tensor, rng: random.Random, stop: int) -> list[int]:
    """A random allowed token per row (a random allowed word, then a random allowed bit: not uniform over
    tokens, which the GIL cost does not depend on); the stop token only when nothing else is allowed."""
    picked = []
    for row in bitmask.tolist():
        words = [w for w, v in enumerate(row) if v]
        candidates = []
        for w in rng.sample(words, min(len(words), 4)):
            v = row[w] & 0xFFFFFFFF
            candidates = [w * 32 + b for b in range(32) if (v >> b) & 1 and w * 32 + b != stop]
            if candidates:
                break
        picked.append(rng.choice(candidates) if candidates else stop)
    return picked


class _FillThreadClock:
    """The fill thread's CPU time per job and inside the library's calls (thread CPU clocks: what other
    processes take from this machine's cores does not count)."""

    def __init__(self, manager, backend) -> None:
        import xgrammar as xgr
        from keel_structured_output_xgrammar import backend as module

        self.jobs: list[float] = []  # ms of CPU per fill-thread job
        self.library: list[float] = []  # ms of CPU on the fill thread inside the library's accept / fill
        self.fills: list[tuple[float, float]] = []  # the library's batch fill calls: (begin, end), perf_counter s
        self._wrap(manager, "_advance", self.jobs)
        self._wrap(manager, "_fill_rows", self.jobs)
        self._wrap(backend, "fill_bitmasks", self.library, spans=self.fills)
        self.restore = []
        if hasattr(module, "_BATCH_ACCEPT"):
            self._wrap(module, "_BATCH_ACCEPT", self.library)
        else:  # before the library's own call was taken directly
            self._wrap(xgr.base._core.BatchGrammarMatcher, "batch_accept_token", self.library, static=True)

    def _wrap(self, obj, name: str, out: list[float], spans: list | None = None, static: bool = False) -> None:
        fn = getattr(obj, name)

        def wrapped(*args, **kwargs):
            c, t = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                out.append((time.thread_time() - c) * 1e3)
                if spans is not None:
                    spans.append((t, time.perf_counter()))
        setattr(obj, name, staticmethod(wrapped) if static else wrapped)

    def clear(self) -> None:
        self.jobs.clear()
        self.library.clear()
        self.fills.clear()


def measure(ns) -> dict:
    import inspect

    from keel_structured_output_xgrammar.backend import FILL_THREADS, XGrammarBackend

    from keel.structured_output.backend import BackendContext
    from keel.structured_output.manager import FILL_SWITCH_INTERVAL_S, StructuredOutputManager
    from keel.structured_output.params import StructuredOutputsParams

    vocab = ns.vocab_size
    hb._use_vocabulary(ns, vocab)  # the engine's backend as h200_bitmask's engine run builds it
    manager = StructuredOutputManager(lambda: XGrammarBackend, lambda: BackendContext(None, vocab, None), vocab,
                                      pin_memory=torch.cuda.is_available())
    params = StructuredOutputsParams(json=hb.SCHEMA)
    # The advance hands back its step's bitmask buffer (when the manager takes it), as the scheduler does.
    hands_back = "bitmask" in inspect.signature(manager.plan_advance).parameters

    def fresh():
        request = manager.add_request(params)
        while not request.is_ready():
            time.sleep(0.001)
        return request.grammar

    ids = [f"r{i}" for i in range(ns.batch)]
    grammars = [fresh() for _ in ids]
    clock = _FillThreadClock(manager, manager._get_backend())
    stop = hb.tokenizer_info(ns, vocab).stop_token_ids[0]
    rng = random.Random(0)
    chunk_us = {_chunk: _chunks_alone(_chunk), _python_chunk: _chunks_alone(_python_chunk)}
    state = {"plan": manager.grammar_bitmask(ids, grammars), "restarted": 0}

    def step(busy: bool, chunk=_chunk) -> dict:
        """One step's fill-thread work with the loop busy (or idle): the tokens of the last bitmask land."""
        tokens = dict(zip(ids, _pick_tokens(state["plan"].bitmask, rng, stop), strict=True))
        landed = threading.Event()
        wait = lambda timeout: tokens if landed.wait(timeout) else None
        advance = (manager.plan_advance(ids, grammars, wait, state["plan"]) if hands_back
                   else manager.plan_advance(ids, grammars, wait))
        plan = manager.plan_bitmask(ids, grammars)
        plan.start()
        durations = []  # (chunk begin s, chunk us)
        clock.clear()
        t0 = time.perf_counter()
        landed.set()
        if busy:
            while not plan.done():
                t = time.perf_counter()
                chunk()
                durations.append((t, (time.perf_counter() - t) * 1e6))
        plan.result()
        chain_ms = (time.perf_counter() - t0) * 1e3
        outcome = advance.result()
        state["plan"] = plan
        restart = False
        for i, rid in enumerate(ids):  # a grammar that ended (or refused: never here) starts over
            accepted, done = outcome.get(rid, (True, grammars[i].is_terminated()))
            if done or not accepted:
                grammars[i], restart = fresh(), True
                state["restarted"] += 1
        if restart:
            state["plan"] = manager.grammar_bitmask(ids, grammars)
        out = {"chain_ms": chain_ms, "fill_thread_cpu_ms": sum(clock.jobs),
               "python_cpu_ms": sum(clock.jobs) - sum(clock.library)}
        if busy:
            # A chunk's excess over its time alone, split by whether the library's fill (GIL released,
            # its threads computing) was running: outside it, what the loop lost is the fill thread's
            # Python and the GIL's switches; inside it, only CPU the fill threads took (none with free cores).
            in_fill = [any(b <= t <= e for b, e in clock.fills) for t, _ in durations]
            excess = [d - chunk_us[chunk] for _, d in durations]
            out["stolen_ms"] = chain_ms - len(durations) * chunk_us[chunk] * 1e-3
            out["stolen_outside_fill_ms"] = sum(x for x, f in zip(excess, in_fill, strict=True) if not f) * 1e-3
        return out

    rows: dict[str, list[float]] = {}
    for i in range(ns.warm_steps + 2 * ns.steps):
        busy = i % 2 == 0  # interleaved: the loop busy, then idle, so both see the same drift
        result = step(busy)
        if i >= ns.warm_steps:
            for k, v in result.items():
                rows.setdefault(k if busy or k != "chain_ms" else "chain_idle_ms", []).append(v)
    # How often the fill thread takes the GIL back from a busy loop: at a long switch interval each take
    # waits one interval, so the busy chain's excess over the idle one counts them.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(TAKE_INTERVAL_S)
    takes = []
    for _ in range(ns.take_steps):
        idle, busy_ = step(False)["chain_ms"], step(True, _python_chunk)["chain_ms"]
        takes.append((busy_ - idle) / (TAKE_INTERVAL_S * 1e3))
    sys.setswitchinterval(interval)
    manager.shutdown()
    out = {name: statistics.median(values) for name, values in rows.items()}
    out.update(gil_takes=statistics.median(takes), gil_takes_all=[round(x, 1) for x in takes], batch=ns.batch,
               vocab=vocab, chunk_us=chunk_us[_chunk], grammars_restarted=state["restarted"],
               fill_threads=ns.fill_threads or FILL_THREADS, switch_interval_ms=FILL_SWITCH_INTERVAL_S * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30, help="steps with the loop busy (as many idle)")
    parser.add_argument("--warm-steps", type=int, default=4)
    parser.add_argument("--take-steps", type=int, default=3, help="steps at a long switch interval (gil_takes)")
    parser.add_argument("--vocab", choices=("bpe", "synthetic"), default="bpe")
    parser.add_argument("--vocab-file", default=None, help="bpe: a tokenizer.json (trained and saved there if absent)")
    parser.add_argument("--fill-threads", type=int, default=None)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None)
    ns = parser.parse_args()
    ns.vocab_size = hb.LLAMA3_8B["vocab_size"]
    if ns.smoke:
        ns.batch, ns.steps, ns.warm_steps, ns.take_steps, ns.vocab_size = 4, 3, 1, 1, hb.SMOKE_VOCAB
        hb.BPE_CORPUS_MB = 2
    from keel.bench import source_commit

    result = {"commit": source_commit(Path(__file__).parent),
              "python": sys.version.split()[0], "host_cpus": hb.host_cpus(), **measure(ns)}
    print(f"fill thread at batch {result['batch']}: takes the GIL back {result['gil_takes']:.0f} times a step, "
          f"{result['python_cpu_ms']:.3f} ms of Python ({result['fill_thread_cpu_ms']:.3f} ms CPU with the "
          f"library's calls); a busy loop lost {result['stolen_ms']:.3f} ms, {result['stolen_outside_fill_ms']:.3f} ms "
          f"outside the library's fill; landed -> filled {result['chain_ms']:.3f} ms busy, "
          f"{result['chain_idle_ms']:.3f} ms idle ({result['fill_threads']} fill threads, host {result['host_cpus']})",
          flush=True)
    print(json.dumps(result, indent=2))
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
