"""`keel bench throughput` and `keel bench latency`: offline measurements of the engine.

Prompts are random token ids (so no tokenizer or dataset is needed); every request generates exactly
`output_len` tokens (ignore_eos). Results are printed, or emitted as JSON with `--json`.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from keel.cli import add_engine_cli_args
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.engine.output_processor import RequestOutputKind
from keel.engine.sampling_params import SamplingParams


def source_commit(cwd: str | Path | None = None) -> str | None:
    """The commit a result file records: $KEEL_COMMIT when set (a device machine's checkout may carry a stale
    .git, so the caller names the commit it copied there), else `git rev-parse` of `cwd`, else None."""
    if os.environ.get("KEEL_COMMIT"):
        return os.environ["KEEL_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=cwd)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    hi = max(vocab_size - 1, 2)
    return [[rng.randrange(1, hi) for _ in range(input_len)] for _ in range(num)]


def run_throughput(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}", {"prompt_token_ids": p}, params)
    outputs = 0
    done = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done += 1
                outputs += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    total_in = sum(len(p) for p in prompts)
    return {
        "num_prompts": len(prompts),
        "elapsed_s": elapsed,
        "requests_per_s": done / elapsed,
        "output_tokens_per_s": outputs / elapsed,
        "total_tokens_per_s": (outputs + total_in) / elapsed,
        "output_tokens": outputs,
    }


def run_latency(engine: LLMEngine, batch_size: int, input_len: int, output_len: int, iters: int,
                vocab_size: int) -> dict[str, Any]:
    """Per-iteration: time to first token and mean time per output token after it, for one batch."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ttfts, tpots, e2es = [], [], []
    for it in range(iters + 1):  # the first iteration warms up
        prompts = random_prompts(batch_size, input_len, vocab_size, seed=it)
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"lat-{it}-{i}", {"prompt_token_ids": p}, params, RequestOutputKind.DELTA)
        first = None
        while engine.has_unfinished_requests():
            outs = engine.step()
            if first is None and any(o.outputs[0].token_ids for o in outs):
                first = time.perf_counter()
        end = time.perf_counter()
        if it == 0:
            continue
        ttfts.append(first - start)
        tpots.append((end - first) / max(output_len - 1, 1))
        e2es.append(end - start)
    return {
        "batch_size": batch_size,
        "ttft_ms": 1e3 * statistics.median(ttfts),
        "time_per_output_token_ms": 1e3 * statistics.median(tpots),
        "e2e_s": statistics.median(e2es),
        "iters": iters,
    }


def add_bench_args(parser) -> None:
    sub = parser.add_subparsers(dest="bench_kind", required=True)
    for kind in ("throughput", "latency"):
        p = sub.add_parser(kind, help=f"offline {kind} benchmark")
        add_engine_cli_args(p, f"bench {kind}")
        p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
        p.add_argument("--output-len", type=int, default=128, help="generated tokens (default: 128)")
        p.add_argument("--json", action="store_true", help="print the result as JSON (default: off)")
        if kind == "throughput":
            p.add_argument("--num-prompts", type=int, default=100, help="prompts per round (default: 100)")
            p.add_argument("--num-rounds", type=int, default=2,
                           help="rounds of distinct prompts; round 1 is the first after start (default: 2)")
        else:
            p.add_argument("--batch-size", type=int, default=1, help="prompts per batch (default: 1)")
            p.add_argument("--num-iters", type=int, default=3, help="timed iterations (default: 3)")


def run_bench(ns) -> int:
    from keel.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(ns))
    vocab = engine.config.model.hf_config.vocab_size
    if ns.bench_kind == "throughput":
        # Every round gets prompts no other run saw (a reused prompt is a prefix-cache hit, not
        # throughput); round 1 is the first big batch after start, later rounds show a warm engine.
        run_throughput(engine, random_prompts(4, ns.input_len, vocab, seed=-1), 4)  # warm-up
        rounds = [run_throughput(engine, random_prompts(ns.num_prompts, ns.input_len, vocab, seed=r),
                                 ns.output_len) for r in range(max(ns.num_rounds, 1))]
        result = dict(rounds[0], rounds=rounds, input_len=ns.input_len, output_len=ns.output_len)
        text = (
            f"Throughput (round 1, the first after start): {result['requests_per_s']:.2f} requests/s, "
            f"{result['output_tokens_per_s']:.1f} output tokens/s, "
            f"{result['total_tokens_per_s']:.1f} total tokens/s ({result['num_prompts']} prompts, "
            f"{ns.input_len} in / {ns.output_len} out, {result['elapsed_s']:.2f} s)"
            + "".join(f"; round {i + 2}: {r['output_tokens_per_s']:.1f} output tokens/s"
                      for i, r in enumerate(rounds[1:]))
        )
    else:
        result = run_latency(engine, ns.batch_size, ns.input_len, ns.output_len, ns.num_iters, vocab)
        result.update(input_len=ns.input_len, output_len=ns.output_len)
        text = (
            f"Latency (batch {ns.batch_size}, {ns.input_len} in / {ns.output_len} out): "
            f"first token {result['ttft_ms']:.1f} ms, per output token "
            f"{result['time_per_output_token_ms']:.2f} ms, end to end {result['e2e_s']:.2f} s"
        )
    print(json.dumps(result, indent=2) if ns.json else text)
    return 0
