"""Per-step host (Python) overhead of the engine, measured on the CPU with a model too small to matter.

    python benchmarks/host_overhead.py [--num-requests 256] [--prompt-len 128] [--output-len 64]
        [--variants greedy,penalties] [--steps decode,prefill,prefill_chunked,mixed] [--repeats 3]
        [--async-scheduling] [--output-kind final_only|delta] [--threads 1] [--profile] [--out FILE.json]

A 1-layer, hidden-64, vocab-1000 random Llama is built in a temporary directory; its forward pass costs
a small fraction of a millisecond, so the time of one `LLMEngine.step()` at N concurrent decoding
requests is almost all scheduler, runner input building, sampling metadata and output processing --
the host work a GPU waits on between graph replays. Only pure-decode steps (every scheduled request
has exactly one new token) are timed; the median over them is reported. On a 2-core CPU the tiny
model's forward (padded decode attention) and the sampler's kernels still take a few ms, so each step's
time inside `model.forward` and `Sampler.forward` is also measured and subtracted: `host_ms` is the
rest -- scheduler, KV manager, input building, sampling metadata, output processing. The same split
in the engine thread's CPU time (`host_cpu_ms`, min over repeats) leaves out what other jobs on a shared
machine add to wall time.

Variants: `greedy` (temperature 0, ignore_eos, no logprobs), `penalties` (temperature 0.8, top-p/top-k,
presence/frequency/repetition penalties, a seed per request, 5 logprobs), `sampled` (temperature 1,
nothing else). `--variants sampled --async-scheduling --output-kind delta` is the loop of
`h200_bitmask.py`'s plain runs (the GPU's default async scheduling, a streamed output per request and
step), whose main-thread parts on the H200 were schedule 1.7, launch 3.0, apply 0.9, output 1.8 ms.
`--profile` prints a cProfile top list of the decode steps of the first variant (and of each step
kind below).

Step kinds (`--steps`, greedy, max_num_batched_tokens 8192, on a second engine whose tiny model allows
8192 positions): `prefill` -- one step of 64 new prompts of 128 tokens (the H200 step profile's prefill);
`prefill_chunked` -- the first step of 3 prompts of 3000 tokens (8192 tokens: two whole prompts and a
chunk of the third); `mixed` -- 256 requests decoding plus a 7936-token prompt chunk; `decode` -- a
batch-256 decode step of the same engine. Each is timed per phase (`add_request` of its new prompts,
`schedule`, the runner's host part, `update_from_output`, the output processor), the model forward and
the sampler apart, so `host_ms` is what the GPU would wait on around a forward it cannot overlap.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from keel.bench import source_commit
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.engine.output_processor import RequestOutputKind
from keel.engine.sampling_params import SamplingParams
from keel.testing.checkpoints import make_checkpoint


def variant_params(variant: str, index: int, output_len: int) -> SamplingParams:
    if variant == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    if variant == "sampled":  # h200_bitmask.py's plain run: random sampling, nothing else
        return SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    if variant == "penalties":
        return SamplingParams(
            temperature=0.8, top_p=0.9, top_k=50, presence_penalty=0.5, frequency_penalty=0.2,
            repetition_penalty=1.1, seed=index, logprobs=5, max_tokens=output_len, ignore_eos=True,
        )
    raise ValueError(f"unknown variant {variant!r}; known: greedy, sampled, penalties")


def build_engine(path: Path, num_requests: int, prompt_len: int, output_len: int,
                 async_scheduling: bool = False) -> LLMEngine:
    args = EngineArgs(
        model=str(path), skip_tokenizer_init=True, dtype="float32", block_size=16,
        max_model_len=prompt_len + output_len, max_num_seqs=num_requests,
        max_num_batched_tokens=max(8192, prompt_len), enable_prefix_caching=True,
        async_scheduling=async_scheduling,
    )
    return LLMEngine.from_engine_args(args)


def run_once(engine: LLMEngine, variant: str, num_requests: int, prompt_len: int, output_len: int,
             profiler: cProfile.Profile | None = None, seed: int = 0,
             kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> dict:
    """Queue all requests, step to completion; returns decode-step times in ms."""
    rng = random.Random(seed)
    vocab = engine.config.model.hf_config.vocab_size
    for i in range(num_requests):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        engine.add_request(f"{variant}-{seed}-{i}", {"prompt_token_ids": prompt},
                           variant_params(variant, i, output_len), kind)
    scheduler = engine.core.scheduler
    runner = engine.core.worker.runner
    device_s: list[float] = []  # model forward + sampler kernels inside the current step
    device_cpu_s: list[float] = []  # the same, in this thread's CPU time

    def timed(fn):
        def call(*a, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                device_s.append(time.perf_counter() - t0)
                device_cpu_s.append(time.thread_time() - c0)
        return call

    # Instance attributes shadow the modules' forward for this run only (removed below).
    runner.model.forward = timed(type(runner.model).forward.__get__(runner.model))
    runner.sampler.forward = timed(type(runner.sampler).forward.__get__(runner.sampler))
    decode_ms: list[float] = []
    host_ms: list[float] = []
    host_cpu_ms: list[float] = []
    num_tokens = 0
    while engine.has_unfinished_requests():
        # A step is pure decode when every running request is past its prompt before it is scheduled
        # (with async scheduling: its token in flight counted).
        pure_decode = not scheduler.waiting and all(
            r.num_computed_tokens == r.num_tokens + r.num_output_placeholders - 1 for r in scheduler.running
        )
        if pure_decode and profiler is not None:
            profiler.enable()
        device_s.clear()
        device_cpu_s.clear()
        start, start_cpu = time.perf_counter(), time.thread_time()
        outs = engine.step()
        elapsed, elapsed_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
        if pure_decode and profiler is not None:
            profiler.disable()
        if pure_decode:
            decode_ms.append(elapsed * 1e3)
            host_ms.append((elapsed - sum(device_s)) * 1e3)
            host_cpu_ms.append((elapsed_cpu - sum(device_cpu_s)) * 1e3)
        num_tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.finished or kind is RequestOutputKind.DELTA)
    del runner.model.forward, runner.sampler.forward
    if num_tokens != num_requests * output_len:
        raise RuntimeError(f"expected {num_requests * output_len} output tokens, got {num_tokens}")
    return {"decode_step_ms": decode_ms, "host_ms": host_ms, "host_cpu_ms": host_cpu_ms}


class PhaseTimer:
    """Wall time spent inside chosen methods of live objects, per step (instance attributes shadow the
    methods while it is active; `close` removes them). Nested phases are each counted in full."""

    def __init__(self, targets: dict[str, tuple[object, str]]) -> None:
        self.spent: dict[str, float] = dict.fromkeys(targets, 0.0)
        self._wrapped = []
        for phase, (obj, name) in targets.items():
            setattr(obj, name, self._timed(phase, getattr(obj, name)))
            self._wrapped.append((obj, name))

    def _timed(self, phase: str, fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.spent[phase] += time.perf_counter() - t0
        return call

    def reset(self) -> None:
        for phase in self.spent:
            self.spent[phase] = 0.0

    def close(self) -> None:
        for obj, name in self._wrapped:
            delattr(obj, name)


PROFILE_SORT = os.environ.get("HOST_PROFILE_SORT", "tottime")  # a pstats sort key ("cumtime", ...)
STEP_KINDS = ("prefill", "prefill_chunked", "mixed", "decode")
STEP_MAX_LEN = 8192  # the step engine's max_model_len and max_num_batched_tokens
DECODERS = 256


def build_step_engine(path: Path) -> LLMEngine:
    args = EngineArgs(
        model=str(path), skip_tokenizer_init=True, dtype="float32", block_size=16,
        max_model_len=STEP_MAX_LEN, max_num_seqs=DECODERS + 64, max_num_batched_tokens=STEP_MAX_LEN,
        enable_prefix_caching=True, num_kv_blocks=8192,
    )
    return LLMEngine.from_engine_args(args)


def step_phases(engine: LLMEngine) -> PhaseTimer:
    core, runner = engine.core, engine.core.worker.runner
    return PhaseTimer({
        "add_request": (engine, "add_request"),
        "schedule": (core.scheduler, "schedule"),
        "runner": (runner, "execute_model_async"),
        "update_states": (runner, "_update_states"),
        "prepare_inputs": (runner.input_batch, "prepare_inputs"),
        "stage": (runner.staging, "stage"),
        "update_from_output": (core.scheduler, "update_from_output"),
        "output_processor": (engine.output_processor, "process_outputs"),
        "sampling_metadata": (runner.sampling_state, "build"),
        "in_flight_track": (runner.in_flight, "track"),
        **{f"attn_metadata_{i}": (b, "build") for i, b in enumerate(runner._builders)},
        # device work (the forward, the LM head, the sampler's kernels): not host time
        "model_forward": (runner.model, "forward"),
        "compute_logits": (runner.model, "compute_logits"),
        "sampler": (runner.sampler, "forward"),
    })


def _prompts(rng: random.Random, vocab: int, count: int, length: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def _decoding(engine: LLMEngine) -> bool:
    sched = engine.core.scheduler
    return not sched.waiting and all(r.num_computed_tokens == r.num_tokens - 1 for r in sched.running)


def run_step_kind(engine: LLMEngine, kind: str, repeats: int, timer: PhaseTimer, seed: int,
                  profiler: cProfile.Profile | None = None) -> list[dict[str, float]]:
    """Per repeat: the phases (ms) of the one step of `kind`, add_request of its prompts included."""
    rng = random.Random(seed)
    vocab = engine.config.model.hf_config.vocab_size
    once = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    records = []
    if kind in ("mixed", "decode"):  # DECODERS requests past their prompts, decoding for the whole run
        long = SamplingParams(temperature=0.0, max_tokens=repeats * 4 + 16, ignore_eos=True)
        for i, p in enumerate(_prompts(rng, vocab, DECODERS, 128)):
            engine.add_request(f"{kind}-{seed}-d{i}", {"prompt_token_ids": p}, long)
        while not _decoding(engine):
            engine.step()
    for r in range(repeats):
        new = {"prefill": (64, 128), "prefill_chunked": (3, 3000), "mixed": (1, STEP_MAX_LEN - DECODERS),
               "decode": (0, 0)}[kind]
        prompts = _prompts(rng, vocab, *new)
        timer.reset()
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"{kind}-{seed}-{r}-{i}", {"prompt_token_ids": p}, once)
        engine.step()
        wall = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
        ms = {phase: t * 1e3 for phase, t in timer.spent.items()}
        ms["wall"] = wall * 1e3
        device = ms["model_forward"] + ms["compute_logits"] + ms["sampler"]
        ms["host"] = ms["wall"] - device
        ms["runner_host"] = ms["runner"] - device
        ms["attn_metadata"] = sum(v for k, v in ms.items() if k.startswith("attn_metadata_"))
        records.append(ms)
        if kind != "decode":  # finish this step's prompts (and chunks) before the next repeat
            sched = engine.core.scheduler
            decoder = f"{kind}-{seed}-d"
            while sched.waiting or any(not r.request_id.startswith(decoder) for r in sched.running):
                engine.step()
    for r in list(engine.core.scheduler.running):
        engine.abort_request(r.request_id.split("#")[0])
    while engine.has_unfinished_requests():
        engine.step()
    return records


def measure_step_kinds(kinds: list[str], repeats: int, profile: bool, profile_top: int) -> dict:
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint("llama", Path(tmp) / "tiny", num_hidden_layers=1, hidden_size=64,
                               intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                               vocab_size=1000, max_position_embeddings=STEP_MAX_LEN)
        engine = build_step_engine(path)
        timer = step_phases(engine)
        try:
            run_step_kind(engine, "prefill", 1, timer, seed=-1)  # warm-up
            for k, kind in enumerate(kinds):
                profiler = cProfile.Profile() if profile else None
                records = run_step_kind(engine, kind, repeats, timer, seed=k, profiler=profiler)
                med = {phase: round(statistics.median(r[phase] for r in records), 3) for phase in records[0]}
                # min too: on a shared machine other jobs only ever add time
                low = {phase: round(min(r[phase] for r in records), 3) for phase in records[0]}
                out[kind] = {"median_ms": med, "min_ms": low, "host_ms_runs": [round(r["host"], 3) for r in records]}
                print(f"{kind:>16}: host {med['host']:.2f} ms (wall {med['wall']:.2f}, forward "
                      f"{med['model_forward']:.2f}, sampler {med['sampler']:.2f}); add_request "
                      f"{med['add_request']:.2f}, schedule {med['schedule']:.2f}, runner host "
                      f"{med['runner_host']:.2f} (update_states {med['update_states']:.2f}, prepare_inputs "
                      f"{med['prepare_inputs']:.2f}, stage {med['stage']:.2f}, attention metadata "
                      f"{med['attn_metadata']:.2f}, sampling metadata {med['sampling_metadata']:.2f}, "
                      f"in-flight tracking {med['in_flight_track']:.2f}), update_from_output "
                      f"{med['update_from_output']:.2f}, output processor {med['output_processor']:.2f}")
                if profiler is not None:
                    buf = io.StringIO()
                    pstats.Stats(profiler, stream=buf).sort_stats(PROFILE_SORT).print_stats(profile_top)
                    print(buf.getvalue())
        finally:
            timer.close()
            engine.shutdown()
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_variants(args, variants: list[str]) -> tuple[dict, str | None]:
    """Pure-decode steps at `args.num_requests` requests per sampling variant; (results, cProfile text)."""
    results: dict[str, dict] = {}
    profile_text = None
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint("llama", Path(tmp) / "tiny", num_hidden_layers=1, hidden_size=64,
                               intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                               vocab_size=1000, max_position_embeddings=args.prompt_len + args.output_len)
        engine = build_engine(path, args.num_requests, args.prompt_len, args.output_len, args.async_scheduling)
        kind = RequestOutputKind[args.output_kind.upper()]
        run_once(engine, variants[0], min(8, args.num_requests), args.prompt_len, 4, seed=-1, kind=kind)  # warm-up
        for v_idx, variant in enumerate(variants):
            medians, host_medians, host_cpu_medians = [], [], []
            for r in range(args.repeats):
                profiler = cProfile.Profile() if args.profile and v_idx == 0 and r == 0 else None
                res = run_once(engine, variant, args.num_requests, args.prompt_len, args.output_len,
                               profiler=profiler, seed=r, kind=kind)
                medians.append(statistics.median(res["decode_step_ms"]))
                host_medians.append(statistics.median(res["host_ms"]))
                host_cpu_medians.append(statistics.median(res["host_cpu_ms"]))
                if profiler is not None:
                    buf = io.StringIO()
                    pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(args.profile_top)
                    profile_text = buf.getvalue()
            results[variant] = {"median_decode_step_ms_runs": medians,
                                "median_decode_step_ms": statistics.median(medians),
                                "median_host_ms_runs": host_medians,
                                "median_host_ms": statistics.median(host_medians),
                                # CPU time of the engine's thread: what other jobs on a shared machine
                                # add to wall time (waiting for a core) is not in it
                                "median_host_cpu_ms_runs": host_cpu_medians,
                                "min_host_cpu_ms": min(host_cpu_medians)}
            print(f"{variant:>10}: median decode step {statistics.median(medians):.2f} ms "
                  f"(runs {', '.join(f'{m:.2f}' for m in medians)}), host part "
                  f"{statistics.median(host_medians):.2f} ms (CPU time: min {min(host_cpu_medians):.2f}) at "
                  f"{args.num_requests} requests")
        engine.shutdown()
    return results, profile_text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--variants", default="greedy,penalties")
    ap.add_argument("--steps", default=",".join(STEP_KINDS),
                    help=f"step kinds to time per phase (of {', '.join(STEP_KINDS)}); empty for none")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-top", type=int, default=30)
    ap.add_argument("--async-scheduling", action="store_true",
                    help="schedule and launch step N+1 before applying step N (the GPU default)")
    ap.add_argument("--output-kind", choices=("final_only", "delta"), default="final_only",
                    help="delta: a RequestOutput per request and step (streaming; h200_bitmask.py's runs)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads; 1 keeps the tiny kernels from fighting over cores")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    variants = [v for v in args.variants.split(",") if v]
    kinds = [k for k in args.steps.split(",") if k]
    unknown = sorted(set(kinds) - set(STEP_KINDS))
    if unknown:
        ap.error(f"unknown step kind(s) {unknown}; known: {', '.join(STEP_KINDS)}")
    results, profile_text = measure_variants(args, variants) if variants else ({}, None)
    steps = measure_step_kinds(kinds, args.repeats, args.profile, args.profile_top) if kinds else {}
    if profile_text is not None:
        print(profile_text)
    if args.out is not None:
        record = {
            "benchmark": "host_overhead",
            "commit": source_commit(Path(__file__).parent) or "unknown",
            "cpu": cpu_name(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "model_shape": {"layers": 1, "hidden": 64, "vocab": 1000},
            "num_requests": args.num_requests,
            "async_scheduling": args.async_scheduling,
            "output_kind": args.output_kind,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "results": results,
            "steps": steps,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
