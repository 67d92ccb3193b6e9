"""Per-step host (Python) overhead of the engine, measured on the CPU with a model too small to matter.

    python benchmarks/host_overhead.py [--num-requests 256] [--prompt-len 128] [--output-len 64]
        [--variants greedy,penalties] [--repeats 3] [--threads 1] [--profile] [--out FILE.json]

A 1-layer, hidden-64, vocab-1000 random Llama is built in a temporary directory; its forward pass costs
a small fraction of a millisecond, so the time of one `LLMEngine.step()` at N concurrent decoding
requests is almost all scheduler, runner input building, sampling metadata and output processing --
the host work a GPU waits on between graph replays. Only pure-decode steps (every scheduled request
has exactly one new token) are timed; the median over them is reported. On a 2-core CPU the tiny
model's forward (padded decode attention) and the sampler's kernels still take a few ms, so each step's
time inside `model.forward` and `Sampler.forward` is also measured and subtracted: `host_ms` is the
rest -- scheduler, KV manager, input building, sampling metadata, output processing.

Variants: `greedy` (temperature 0, ignore_eos, no logprobs), `penalties` (temperature 0.8, top-p/top-k,
presence/frequency/repetition penalties, a seed per request, 5 logprobs).
`--profile` prints a cProfile top list of the decode steps of the first variant.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.engine.sampling_params import SamplingParams
from keel.testing.checkpoints import make_checkpoint


def variant_params(variant: str, index: int, output_len: int) -> SamplingParams:
    if variant == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    if variant == "penalties":
        return SamplingParams(
            temperature=0.8, top_p=0.9, top_k=50, presence_penalty=0.5, frequency_penalty=0.2,
            repetition_penalty=1.1, seed=index, logprobs=5, max_tokens=output_len, ignore_eos=True,
        )
    raise ValueError(f"unknown variant {variant!r}; known: greedy, penalties")


def build_engine(path: Path, num_requests: int, prompt_len: int, output_len: int) -> LLMEngine:
    args = EngineArgs(
        model=str(path), skip_tokenizer_init=True, dtype="float32", block_size=16,
        max_model_len=prompt_len + output_len, max_num_seqs=num_requests,
        max_num_batched_tokens=max(8192, prompt_len), enable_prefix_caching=True,
    )
    return LLMEngine.from_engine_args(args)


def run_once(engine: LLMEngine, variant: str, num_requests: int, prompt_len: int, output_len: int,
             profiler: cProfile.Profile | None = None, seed: int = 0) -> dict:
    """Queue all requests, step to completion; returns decode-step times in ms."""
    rng = random.Random(seed)
    vocab = engine.config.model.hf_config.vocab_size
    for i in range(num_requests):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        engine.add_request(f"{variant}-{seed}-{i}", {"prompt_token_ids": prompt},
                           variant_params(variant, i, output_len))
    scheduler = engine.core.scheduler
    runner = engine.core.worker.runner
    device_s: list[float] = []  # model forward + sampler kernels inside the current step

    def timed(fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                device_s.append(time.perf_counter() - t0)
        return call

    # Instance attributes shadow the modules' forward for this run only (removed below).
    runner.model.forward = timed(type(runner.model).forward.__get__(runner.model))
    runner.sampler.forward = timed(type(runner.sampler).forward.__get__(runner.sampler))
    decode_ms: list[float] = []
    host_ms: list[float] = []
    num_tokens = 0
    while engine.has_unfinished_requests():
        # A step is pure decode when every running request is past its prompt before it is scheduled.
        pure_decode = not scheduler.waiting and all(
            r.num_computed_tokens == r.num_tokens - 1 for r in scheduler.running
        )
        if pure_decode and profiler is not None:
            profiler.enable()
        device_s.clear()
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        if pure_decode and profiler is not None:
            profiler.disable()
        if pure_decode:
            decode_ms.append(elapsed * 1e3)
            host_ms.append((elapsed - sum(device_s)) * 1e3)
        num_tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
    del runner.model.forward, runner.sampler.forward
    if num_tokens != num_requests * output_len:
        raise RuntimeError(f"expected {num_requests * output_len} output tokens, got {num_tokens}")
    return {"decode_step_ms": decode_ms, "host_ms": host_ms}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--variants", default="greedy,penalties")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-top", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads; 1 keeps the tiny kernels from fighting over cores")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    variants = [v for v in args.variants.split(",") if v]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint("llama", Path(tmp) / "tiny", num_hidden_layers=1, hidden_size=64,
                               intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                               vocab_size=1000, max_position_embeddings=args.prompt_len + args.output_len)
        engine = build_engine(path, args.num_requests, args.prompt_len, args.output_len)
        run_once(engine, variants[0], min(8, args.num_requests), args.prompt_len, 4, seed=-1)  # warm-up
        profile_text = None
        for v_idx, variant in enumerate(variants):
            medians, host_medians = [], []
            for r in range(args.repeats):
                profiler = cProfile.Profile() if args.profile and v_idx == 0 and r == 0 else None
                res = run_once(engine, variant, args.num_requests, args.prompt_len, args.output_len,
                               profiler=profiler, seed=r)
                medians.append(statistics.median(res["decode_step_ms"]))
                host_medians.append(statistics.median(res["host_ms"]))
                if profiler is not None:
                    buf = io.StringIO()
                    pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(args.profile_top)
                    profile_text = buf.getvalue()
            results[variant] = {"median_decode_step_ms_runs": medians,
                                "median_decode_step_ms": statistics.median(medians),
                                "median_host_ms_runs": host_medians,
                                "median_host_ms": statistics.median(host_medians)}
            print(f"{variant:>10}: median decode step {statistics.median(medians):.2f} ms "
                  f"(runs {', '.join(f'{m:.2f}' for m in medians)}), host part "
                  f"{statistics.median(host_medians):.2f} ms at {args.num_requests} requests")
        engine.shutdown()
    if profile_text is not None:
        print(profile_text)
    if args.out is not None:
        record = {
            "benchmark": "host_overhead",
            "commit": git_commit(),
            "cpu": cpu_name(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "model_shape": {"layers": 1, "hidden": 64, "vocab": 1000},
            "num_requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "results": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
