"""Reference cycles per engine step: what the cyclic garbage collector finds in a decode step, and how often it runs.

    python benchmarks/gc_per_step.py --out benchmarks/results/h200-gc-per-step.json [--batch 256] [--steps 128]
    python benchmarks/gc_per_step.py --smoke [--out x.json]   # CPU, tiny shapes: checks the script runs

The engine of benchmarks/h200_bitmask.py (Llama-3-8B shape, dummy weights, async scheduling, the runner in
this process, CUDA graphs, xgrammar; `make_engine`) with `batch` requests decoding together at temperature
1.0, none constrained (`plain`) and every one JSON-schema constrained (`constrained`); each run:

  1. `served`: the collector on, as in serving; per generation, the collections during `steps` decode
     steps (gc.callbacks), per 100 steps, the objects they freed per step and their pauses;
  2. `cyclic`: `steps` more steps with the collector off, then one gc.collect() with gc.DEBUG_SAVEALL --
     the objects the steps left in reference cycles (per step, and their types). Garbage freed by
     reference counting is not there; one cycle per step is `steps` objects or more.

Both again with benchmarks/bitmask_timeline.py's StepTimeline attached (`*_timeline`), which h200_bitmask.py
measures with. On the CPU (tests/test_step_gc_cycles.py) the engine leaves 0 objects in cycles; this
covers what only a GPU runs -- CUDA events and pinned copies of the sampled tokens, the CUDA graph replay,
Triton launches, the compiled sampler noise.

Measured on the CPU (2 cores, --smoke --batch 256 --steps 100, tiny model): the engine alone 0 objects per
step in cycles; with the timeline attached 276 (plain) / 272 (constrained) with 0b616fa's timeline and 0
with this one; the collector on, 183 gen-0 and 16 gen-1 collections per 100 steps and one gen-2 in
every run, either timeline -- gen-1 collections freed 178.8 objects per step with the old timeline, 0 now.

Prediction for the H200 (this script's first run there; batch 256, 128 steps): `cyclic.per_step` 0 in all
four runs; `served`: gen-1 and gen-2 collections free ~0 objects (h200_bitmask's runs at 0b616fa: 23.5k by
21 gen-1 and 8-13k by 2 gen-2 collections per run: ~180 and ~60-100 objects per step; the CPU's with the
old timeline at batch 256: 179 and 30), while their counts stay as at 0b616fa (~182 gen-0 and ~16 gen-1 per
100 steps, 1-2 gen-2 per run): gen-0 collections are triggered by the 700+ tracked objects a batch-256 step
holds alive at once (outputs, token lists), not by cycles, and the CPU counts did not move. The gen-2
pause should shrink from 8-30 ms toward the walk of the ~10k tracked objects alone (a few ms), as it frees
nothing any more.
"""

from __future__ import annotations

import argparse
import gc
import platform
from pathlib import Path

import torch


def collections_during(step, steps: int) -> dict:
    """Per generation, the collector's runs during `steps` calls of `step()`, the collector on."""
    from keel.testing.cycles import CollectionLog

    gc.collect()
    log = CollectionLog().attach()
    try:
        for _ in range(steps):
            step()
    finally:
        log.detach()
    return {g: {**v, "per_100_steps": 100 * v["count"] / steps, "collected_per_step": v["collected"] / steps}
            for g, v in log.by_generation().items()}


def cycles_during(step, steps: int) -> dict:
    """The objects `steps` calls of `step()` leave in reference cycles, the collector off meanwhile."""
    from keel.testing.cycles import cyclic_garbage

    def work() -> None:
        for _ in range(steps):
            step()
    found, kinds = cyclic_garbage(work)
    return {"objects": found, "per_step": found / steps, "by_type": dict(kinds.most_common(15))}


def run(engine, ns, vocab: int, constrained: bool, seed: int) -> dict:
    from h200_bitmask import SCHEMA  # benchmarks/ is on sys.path when this script runs

    from keel.bench import random_prompts
    from keel.engine.output_processor import RequestOutputKind
    from keel.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=ns.warm_steps + 2 * ns.steps + 16, ignore_eos=True,
                            detokenize=False, structured_outputs={"json": SCHEMA} if constrained else None)
    ids = [f"s{seed}-{i}" for i in range(ns.batch)]
    for rid, prompt in zip(ids, random_prompts(ns.batch, ns.input_len, vocab, seed=seed)):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params, RequestOutputKind.DELTA)
    tokens = dict.fromkeys(ids, 0)

    def step() -> None:
        for out in engine.step():
            tokens[out.request_id] += len(out.outputs[0].token_ids)

    while min(tokens.values()) == 0:  # prefill (and the grammar's compile)
        step()
    for _ in range(ns.warm_steps):
        step()
    running = sum(1 for r in ids if r in engine.core.scheduler.requests)
    out = {"served": collections_during(step, ns.steps), "cyclic": cycles_during(step, ns.steps),
           "running_at_start": running,
           "running_at_end": sum(1 for r in ids if r in engine.core.scheduler.requests)}
    for r in ids:
        engine.abort_request(r)
    while engine.has_unfinished_requests():
        engine.step()
    return out


def main() -> None:
    from bitmask_timeline import StepTimeline
    from h200_bitmask import SMOKE_VOCAB, emit, make_engine

    from keel.bench import source_commit

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=None, help="requests decoding together (256; --smoke 4)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=None, help="decode steps per phase of a run (128; --smoke 6)")
    parser.add_argument("--warm-steps", type=int, default=8)
    parser.add_argument("--vocab", choices=("bpe", "synthetic"), default="synthetic",
                        help="the grammars' vocabulary (h200_bitmask.py's; its cost does not change the cycles)")
    parser.add_argument("--vocab-file", default=None, help="bpe: a tokenizer.json (see h200_bitmask.py)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model and batch: the script runs")
    parser.add_argument("--out", default=None, help="write the results as JSON here (also printed)")
    ns = parser.parse_args()
    ns.fill_threads = None  # the backend's count (h200_bitmask's make_engine reads it)
    device = "cpu" if ns.smoke else "cuda"
    if ns.smoke:
        ns.layers, ns.input_len, ns.warm_steps, ns.vocab = 1, 8, 2, "synthetic"
    ns.batch = ns.batch or (4 if ns.smoke else 256)
    ns.steps = ns.steps or (6 if ns.smoke else 128)
    engine, vocab = make_engine(ns, device)
    assert vocab == (SMOKE_VOCAB if ns.smoke else 128256)
    result = {"batch": ns.batch, "steps": ns.steps, "vocab": vocab, "layers": ns.layers,
              "python": platform.python_version(), "device": "cpu" if ns.smoke else torch.cuda.get_device_name(),
              "torch": torch.__version__,
              "commit": source_commit(Path(__file__).parent), "gc_threshold": gc.get_threshold(),
              "frozen": gc.get_freeze_count(), "runs": {}}
    runs = result["runs"]
    for i, name in enumerate(("plain", "constrained", "plain_timeline", "constrained_timeline")):
        timeline = StepTimeline().attach(engine) if name.endswith("_timeline") else None
        runs[name] = run(engine, ns, vocab, name.startswith("constrained"), seed=i)
        if timeline is not None:
            timeline.detach()
        served = runs[name]["served"]
        print(f"{name}: {runs[name]['cyclic']['per_step']:.1f} objects per step in cycles "
              f"{runs[name]['cyclic']['by_type']}; collector on, per 100 steps: " + ", ".join(
                  f"{g} {v['per_100_steps']:.0f} x (freed {v['collected_per_step']:.1f}/step, max {v['max_ms']} ms)"
                  for g, v in served.items()), flush=True)
    engine.shutdown()
    result["tracked_after"] = len(gc.get_objects())
    emit(result, ns.out)


if __name__ == "__main__":
    main()
