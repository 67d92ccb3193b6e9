"""The per-step cost of structured outputs' token bitmask at batch 256, against a plain decode step.

    python benchmarks/h200_bitmask.py --out benchmarks/results/h200-bitmask.json [--batch 256] [--layers 32]
    python benchmarks/h200_bitmask.py --smoke [--out x.json]   # CPU, tiny shapes: checks the script runs

Needs the core, plugins models-llama / attention-flash / kernels-triton / platform-cuda (the cuda
profile's plugins), structured-output-xgrammar and xgrammar (with its apache-tvm-ffi).

On one device (Llama-3-8B shape, vocab 128256, bf16, random weights):
  1. engine: one engine (load_format="dummy", async scheduling), `batch` requests with distinct random
     prompts decoding together; ms per step over `--steps` decode steps with no request constrained
     (`plain_step_ms`, also `decode_step_ms`), with every request constrained by a JSON schema
     (`constrained_step_ms`; each of the two means of two runs, plain and constrained
     interleaved, as the plain step drifts by several percent between runs; each step is launched before the previous one's tokens are on the host; the
     bitmask is filled while the forward runs), and the former path for comparison (a constrained
     request skips the step after each of its tokens: `every_other_step`). `overhead_fraction` =
     constrained / plain - 1 per step in which every request advances one token (target < 5%). Each run
     has a `breakdown` (benchmarks/bitmask_timeline.py: the engine loop's parts, when the fill starts
     after its step's launch, how long the fill thread waits for the GIL to wake, the fill job and the
     library's batch fill in it, how long sampling waited); `constrained_default_switch_interval` is the
     constrained run at CPython's default 5 ms GIL switch interval (the engine lowers it). The
     grammar library sees a synthetic vocabulary of the model's size (the engine's tokenizer is a small
     local one; xgrammar's fill cost depends on the vocabulary size and the grammar state);
  2. device_ms: what a constrained step adds on the device -- the bitmask's host-to-device copy from
     pinned memory plus the mask on [batch, vocab] float32 logits: `device_ms` with the bound kernel
     (kernels-triton's apply_token_bitmask, one fused kernel over the packed words) and
     `device_ms_torch_reference` with the torch reference (unpack, masked_fill, index_copy);
  3. host_fill_ms: `StructuredOutputManager.grammar_bitmask` for `batch` xgrammar matchers of the same
     schema alone (xgrammar's threaded batch fill; wall clock, median over steps; each matcher then
     accepts an allowed token, so the states move as in decoding), and host_fill_sequential_ms, the
     same rows filled one matcher at a time.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
             "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1,
             "eos_token_id": 2}
SMOKE_VOCAB = 2048  # --smoke: still more than the local test tokenizer's 512 tokens
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"]}}, "required": ["name", "age", "tags", "address"]}


def _model_dir(ns) -> tuple[Path, int]:
    """A Llama-3-8B-shape config (tiny with --smoke) and the small local test tokenizer; (dir, vocab)."""
    from transformers import LlamaConfig

    from keel.testing.tokenizer import build_tokenizer

    shape = {**LLAMA3_8B, "num_hidden_layers": ns.layers}
    if ns.smoke:
        shape.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=SMOKE_VOCAB)
    cfg = LlamaConfig(**shape)
    cfg.architectures = ["LlamaForCausalLM"]
    model_dir = Path(tempfile.mkdtemp()) / "llama8b-shape"
    cfg.save_pretrained(model_dir)
    build_tokenizer(model_dir)  # the front end needs one; the grammars see the synthetic vocabulary
    return model_dir, cfg.vocab_size


def _use_vocabulary(ns, vocab: int) -> None:
    """The engine's xgrammar backend builds its matchers over the benchmark's vocabulary of `vocab` tokens,
    and fills with `--fill-threads` threads when given."""
    import xgrammar as xgr
    from keel_structured_output_xgrammar import backend

    info = tokenizer_info(ns, vocab)
    threads = ns.fill_threads or backend.FILL_THREADS

    def init(self, ctx) -> None:
        self.info = info
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    backend.XGrammarBackend.__init__ = init


def make_engine(ns, device: str):
    """(engine, vocab): the benchmark's engine (also benchmarks/gc_per_step.py's) -- async scheduling, the
    runner in this process, xgrammar over the `ns.vocab` vocabulary; `ns.batch` requests at most."""
    from keel.config import EngineArgs
    from keel.engine.llm_engine import LLMEngine

    model_dir, vocab = _model_dir(ns)
    _use_vocabulary(ns, vocab)
    return LLMEngine.from_engine_args(EngineArgs(
        model=str(model_dir), profile="cpu" if device == "cpu" else "cuda", load_format="dummy",
        plugins=(["platform-cpu", "attention-torch", "models-llama"] if device == "cpu" else
                 ["platform-cuda", "attention-flash", "attention-torch", "kernels-triton", "models-llama"])
        + ["structured-output-xgrammar"],
        dtype="float32" if device == "cpu" else "bfloat16", max_model_len=512, async_scheduling=True,
        max_num_seqs=ns.batch, max_num_batched_tokens=8192, seed=0,
        **({} if device == "cpu" else {"gpu_memory_utilization": 0.6}))), vocab


def engine_steps(ns, device: str) -> dict:
    """ms per decode step of one engine at `batch` requests, none vs every one JSON-schema constrained."""
    from bitmask_timeline import StepTimeline  # benchmarks/ is on sys.path when this script runs

    from keel.bench import random_prompts
    from keel.engine.output_processor import RequestOutputKind
    from keel.engine.sampling_params import SamplingParams

    engine, vocab = make_engine(ns, device)
    core = engine.core
    timeline = StepTimeline().attach(engine)  # the step's breakdown: main thread, fill thread, runner
    counter = iter(range(1 << 30))

    def run(constrained: bool, seed: int) -> dict:
        params = SamplingParams(temperature=1.0, max_tokens=ns.warm_steps + ns.steps + 16, ignore_eos=True,
                                detokenize=False, structured_outputs={"json": SCHEMA} if constrained else None)
        ids = []
        for prompt in random_prompts(ns.batch, ns.input_len, vocab, seed=seed):
            ids.append(f"r{next(counter)}")
            engine.add_request(ids[-1], {"prompt_token_ids": prompt}, params, RequestOutputKind.DELTA)
        tokens = dict.fromkeys(ids, 0)

        def step() -> int:
            new = 0
            for out in engine.step():
                n = len(out.outputs[0].token_ids)
                tokens[out.request_id] += n
                new += n
            return new

        while min(tokens.values()) == 0:  # prefill (and the grammar's compile)
            step()
        for _ in range(ns.warm_steps):
            step()
        running = sum(1 for r in ids if r in core.scheduler.requests)
        manager = core.scheduler.structured_output
        allocated = manager.num_buffers_allocated
        timeline.clear()
        t = time.perf_counter()
        new = sum(step() for _ in range(ns.steps))
        elapsed_ms = (time.perf_counter() - t) * 1e3
        finished = running - sum(1 for r in ids if r in core.scheduler.requests)  # grammars that ended
        for r in ids:
            engine.abort_request(r)
        while engine.has_unfinished_requests():
            engine.step()
        tokens_per_step = new / ns.steps
        breakdown = timeline.summary()
        # bitmask buffers allocated during the timed steps (0: each step's fill reused a sampled step's)
        breakdown["buffers_allocated"] = manager.num_buffers_allocated - allocated
        return {"ms_per_step": elapsed_ms / ns.steps, "tokens_per_step": tokens_per_step,
                # the time in which every running request advances by one token
                "ms_per_token_step": elapsed_ms / ns.steps * running / max(tokens_per_step, 1e-9),
                "running_at_start": running, "finished_during": finished,
                "switch_interval_ms": sys.getswitchinterval() * 1e3, "breakdown": breakdown,
                # the fill thread's whole job per step, and how long sampling waited for it
                "host_fill_ms": breakdown.get("fill_job_ms"), "runner_wait_ms": breakdown.get("runner_wait_ms")}

    # A plain run first, not counted: the first run after start was the slowest in both H200 runs at
    # 8c848ae / 9a29d57 (11.5-11.6 ms a step against 9.4-10.0 for the later plain run), which biased the
    # means of plain and constrained runs against the plain step.
    out = {"warm_up_plain": run(False, 0)}
    out["plain"] = run(False, 1)
    out["constrained"] = run(True, 2)
    engine_interval = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # CPython's default: how long the fill thread may wait for the GIL
    out["constrained_default_switch_interval"] = run(True, 4)
    sys.setswitchinterval(engine_interval)
    core.scheduler.constrained_in_flight = False  # the former path: skip the step after each token
    out["every_other_step"] = run(True, 3)
    core.scheduler.constrained_in_flight = True
    # Both again: the plain step drifts by several percent between runs of new prompts, so the overhead
    # compares the means of two runs each, plain and constrained interleaved.
    out["plain_after"] = run(False, 5)
    out["constrained_after"] = run(True, 6)
    import xgrammar as xgr

    backend = core.scheduler.structured_output._get_backend()
    default_batch = backend.batch
    for i, threads in enumerate(ns.fill_threads_also):  # the same engine, xgrammar's fill on other counts
        backend.batch = xgr.BatchGrammarMatcher(max_threads=threads)
        out[f"constrained_{threads}_threads"] = run(True, 7 + i)
    backend.batch = default_batch
    timeline.detach()
    engine.shutdown()
    plain = statistics.mean(out[k]["ms_per_token_step"] for k in ("plain", "plain_after"))
    out["plain_step_ms"] = plain
    out["constrained_step_ms"] = statistics.mean(out[k]["ms_per_token_step"] for k in ("constrained",
                                                                                         "constrained_after"))
    out["overhead_fraction"] = out["constrained_step_ms"] / plain - 1
    out["default_switch_interval_overhead_fraction"] = (
        out["constrained_default_switch_interval"]["ms_per_token_step"] / plain - 1)
    out["every_other_step_overhead_fraction"] = out["every_other_step"]["ms_per_token_step"] / plain - 1
    # The same by each run's median engine step: a run's mean moves with its few long steps (see each
    # breakdown's engine_step_max_ms, gc and trace_slowest), which the plain runs have too.
    med = {k: out[k]["breakdown"].get("engine_step_ms") for k in ("plain", "plain_after", "constrained",
                                                                    "constrained_after")}
    if all(med.values()):
        out["median_step_overhead_fraction"] = (statistics.mean([med["constrained"], med["constrained_after"]])
                                                / statistics.mean([med["plain"], med["plain_after"]]) - 1)
    out["plain_drift_fraction"] = out["plain_after"]["ms_per_token_step"] / out["plain"]["ms_per_token_step"] - 1
    return out


def host_cpus() -> dict:
    """Logical CPUs, those this process may run on, and physical cores (Linux topology; None elsewhere):
    the fill threads share cores with the engine loop when there are fewer physical cores than CPUs."""
    import os

    from keel_structured_output_xgrammar.backend import physical_cores

    return {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else None, "physical_cores": physical_cores()}


def _median_ms(fn, device: str, iters: int = 50) -> float:
    if device != "cpu":
        from h200_llama8b import _events_ms  # benchmarks/ is on sys.path when this script runs

        return _events_ms(fn, iters=iters, warmup=5)
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def device_ms(batch: int, vocab: int, device: str, apply=None) -> float:
    """Copy + mask on the device with `apply(logits, bitmask, rows)` (default: the torch reference)."""
    from keel.layers.token_bitmask import apply_token_bitmask
    from keel.structured_output.backend import bitmask_width

    apply = apply or apply_token_bitmask
    logits = torch.randn(batch, vocab, dtype=torch.float32, device=device)
    host = torch.randint(-(2**31), 2**31 - 1, (batch, bitmask_width(vocab)), dtype=torch.int32,
                         pin_memory=device != "cpu")
    rows = torch.arange(batch, device=device)

    def step():
        bitmask = host.to(device, non_blocking=True)
        apply(logits, bitmask, rows)

    return _median_ms(step, device)


def fused_kernel():
    """kernels-triton's apply_token_bitmask op, or None where it cannot run (the CPU without the interpreter)."""
    try:
        from keel_kernels_triton.token_bitmask import TritonApplyTokenBitmask
    except ImportError:
        return None
    op = TritonApplyTokenBitmask()
    return op if op.supports("cuda" if torch.cuda.is_available() else "cpu", torch.float32) else None


def tokenizer_info(ns, vocab: int):
    """The vocabulary the grammars see: `--vocab bpe` (byte-level BPE, see bpe_tokenizer_info) or
    `--vocab synthetic` (random strings over a JSON-heavy alphabet: a pessimistic case)."""
    if ns.vocab == "synthetic":
        return synthetic_tokenizer_info(vocab)
    return bpe_tokenizer_info(vocab, ns.vocab_file)


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins (GPT-2's table) back to the bytes they stand for."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


@functools.cache
def bpe_tokenizer_info(vocab: int, path: str | None):
    """A byte-level BPE vocabulary of `vocab` tokens like Llama-3's: read from `path` (a tokenizer.json)
    when it exists, else trained on the Python sources of this interpreter's library and packages
    (the machine has no model to download; a minute or two) and saved there. Code is quote-heavy, so its share of tokens with
    a `"` -- the tokens a JSON string state must check one by one -- is if anything higher than a
    web-trained vocabulary's; `vocab_stats` records it. Ids past the trained ones are reserved special
    tokens (never allowed by a grammar), as Llama-3 reserves 256."""
    import xgrammar as xgr
    from tokenizers import Tokenizer

    if path and Path(path).exists():
        tok = Tokenizer.from_file(path)
    else:
        tok = _train_bpe(vocab - 256)
        if path:
            tok.save(path)
    table = _byte_decoder()
    pieces = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [bytes(table[ch] for ch in piece) for piece, _ in pieces][:vocab - 1]
    special = [b""] * (vocab - len(tokens))  # xgrammar's special tokens: empty; the first is the end token
    BPE_STATS.update(trained_tokens=len(tokens), quote_fraction=sum(b'"' in t for t in tokens) / len(tokens),
                     mean_bytes=statistics.mean(len(t) for t in tokens))
    return xgr.TokenizerInfo(tokens + special, vocab_type=xgr.VocabType.RAW, vocab_size=vocab,
                             stop_token_ids=[len(tokens)])


BPE_STATS: dict = {}
BPE_CORPUS_MB = 240


def _train_bpe(size: int):
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files, total = [], 0
    stdlib = [f for f in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py") if "site-packages" not in f.parts]
    packages = Path(sysconfig.get_paths()["purelib"]).rglob("*.py")
    for f in sorted(stdlib) + sorted(packages):  # the interpreter's own library, then the installed packages
        if total > BPE_CORPUS_MB * 1e6:
            break
        try:
            f.read_text(encoding="utf-8")  # the trainer stops at a file that is not UTF-8
        except (UnicodeDecodeError, OSError):
            continue
        files.append(str(f))
        total += f.stat().st_size
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=size, min_frequency=2, show_progress=False,
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    BPE_STATS.update(corpus_mb=total / 1e6, corpus="the Python library's and installed packages' *.py")
    return tok


@functools.cache  # ~1 s of Python per build; the host fill and the engine share it
def synthetic_tokenizer_info(vocab: int):
    import xgrammar as xgr

    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-.,:;\"'{}[]()"
    tokens: list[bytes] = [b"<pad>", b"<s>", b"</s>"] + [bytes([i]) for i in range(256)]
    seen = set(tokens)
    while len(tokens) < vocab:
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8))).encode()
        if word not in seen:
            seen.add(word)
            tokens.append(word)
    return xgr.TokenizerInfo(tokens, vocab_type=xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=[2])


def host_fill_ms(ns, batch: int, vocab: int, steps: int) -> dict:
    from keel_structured_output_xgrammar.backend import FILL_THREADS, XGrammarBackend

    from keel.structured_output.backend import BackendContext
    from keel.structured_output.manager import StructuredOutputManager
    from keel.structured_output.params import StructuredOutputsParams

    _use_vocabulary(ns, vocab)  # the engine's backend as the engine run builds it
    manager = StructuredOutputManager(lambda: XGrammarBackend, lambda: BackendContext(None, vocab, 2), vocab)
    t = time.perf_counter()
    requests = [manager.add_request(StructuredOutputsParams(json=SCHEMA)) for _ in range(batch)]
    while not all(r.is_ready() for r in requests):
        time.sleep(0.01)
    compile_s = time.perf_counter() - t
    grammars = [r.grammar for r in requests]
    ids = [f"r{i}" for i in range(batch)]
    rng = random.Random(1)
    times: dict[str, list[float]] = {"batched": [], "sequential": []}
    for step in range(steps):
        t = time.perf_counter()
        out = manager.grammar_bitmask(ids, grammars)  # the engine's path: xgrammar's threaded batch fill
        times["batched"].append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        seq = torch.full_like(out.bitmask, -1)
        for row, g in enumerate(grammars):  # one matcher at a time, for comparison
            if not g.is_terminated():
                g.fill_bitmask(seq, row)
        times["sequential"].append((time.perf_counter() - t) * 1e3)
        if step == 0:
            assert torch.equal(seq, out.bitmask), "batched and sequential fills differ"
        allowed = out.bitmask  # [batch, words]
        for i, g in enumerate(grammars):  # each matcher accepts an allowed token: states move as in decoding
            words = torch.nonzero(allowed[i]).flatten().tolist()
            if not words or g.is_terminated():
                continue
            w = rng.choice(words)
            bits = [b for b in range(32) if (int(allowed[i, w]) >> b) & 1]
            g.accept_tokens([w * 32 + rng.choice(bits)])
    manager.shutdown()
    return {"host_fill_ms": statistics.median(times["batched"]),
            "host_fill_sequential_ms": statistics.median(times["sequential"]),
            "fill_threads": ns.fill_threads or FILL_THREADS,
            "compile_s": compile_s}


def emit(result: dict, out: str | None) -> None:
    """Print the results as JSON, and write them to `out` when given (also benchmarks/gc_per_step.py's)."""
    print(json.dumps(result, indent=2))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
        print("wrote", out)


def main() -> None:
    from keel.bench import source_commit

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps per engine run (128; --smoke 3)")
    parser.add_argument("--warm-steps", type=int, default=8, help="decode steps before timing")
    parser.add_argument("--fill-steps", type=int, default=30)
    parser.add_argument("--vocab", choices=("bpe", "synthetic"), default="bpe",
                        help="the grammars' vocabulary: byte-level BPE (trained here) or random strings")
    parser.add_argument("--vocab-file", default=None, help="bpe: a tokenizer.json to use (or to save the trained one)")
    parser.add_argument("--fill-threads", type=int, default=None, help="xgrammar's batch fill threads "
                        "(default: the backend's FILL_THREADS)")
    parser.add_argument("--fill-threads-also", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                        help="comma-separated thread counts: one more constrained run at each, the same engine")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model and batch: the script runs")
    parser.add_argument("--out", default=None, help="write the results as JSON here (also printed)")
    ns = parser.parse_args()
    ns.steps = ns.steps if ns.steps or ns.smoke else 128
    device = "cpu" if ns.smoke else "cuda"
    if ns.smoke:
        ns.batch, ns.layers, ns.input_len, ns.warm_steps, ns.fill_steps = 4, 1, 8, 1, 3
        ns.steps = ns.steps or 3
        global BPE_CORPUS_MB
        BPE_CORPUS_MB = 2  # a 2048-token vocabulary needs little text
    vocab = SMOKE_VOCAB if ns.smoke else LLAMA3_8B["vocab_size"]
    result = {"batch": ns.batch, "vocab": vocab, "layers": ns.layers, "device":
              "cpu" if ns.smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
              "python": platform.python_version(),
              "commit": source_commit(Path(__file__).parent)}
    kernel = fused_kernel()
    result["device_ms_torch_reference"] = device_ms(ns.batch, vocab, device)
    result["device_ms"] = None if kernel is None else device_ms(ns.batch, vocab, device, kernel)
    print(f"bitmask copy + mask on the device: fused kernel {result['device_ms']} ms, torch reference "
          f"{result['device_ms_torch_reference']:.3f} ms", flush=True)
    result.update(host_fill_ms(ns, ns.batch, vocab, ns.fill_steps))
    result["host_cpus"] = host_cpus()
    result["vocab_kind"] = ns.vocab
    result["vocab_stats"] = dict(BPE_STATS)
    print(f"host fill of {ns.batch} xgrammar matchers: {result['host_fill_ms']:.3f} ms batched, "
          f"{result['host_fill_sequential_ms']:.3f} ms one by one (schema compile {result['compile_s']:.2f} s)",
          flush=True)
    result["engine"] = engine_steps(ns, device)
    eng = result["engine"]
    step = result["decode_step_ms"] = eng["plain_step_ms"]
    result["device_fraction"] = (result["device_ms"] or result["device_ms_torch_reference"]) / step
    print(f"engine at batch {ns.batch}: plain {step:.3f} ms per step, all constrained "
          f"{eng['constrained_step_ms']:.3f} ms ({100 * eng['overhead_fraction']:+.2f}%, target < 5%); the "
          f"every-other-step path {100 * eng['every_other_step_overhead_fraction']:+.2f}%; device cost alone "
          f"{100 * result['device_fraction']:.2f}% of the plain step; plain step drift over the runs "
          f"{100 * eng['plain_drift_fraction']:+.2f}% ({ns.vocab} vocabulary, {result['fill_threads']} fill threads, "
          f"{result['vocab_stats']})", flush=True)
    runs = {k: v for k, v in eng.items() if isinstance(v, dict) and "breakdown" in v}
    print(f"by the median engine step: {100 * eng.get('median_step_overhead_fraction', float('nan')):+.2f}%; "
          "longest step / garbage collections per run: " + "; ".join(
              f"{k} {v['breakdown'].get('engine_step_max_ms') or 0:.1f} ms / "
              f"{ {g: c for g, c in v['breakdown'].get('gc', {}).items() if g.startswith('gen')} }"
              for k, v in runs.items()), flush=True)
    gc_seen = eng["constrained_after"]["breakdown"].get("gc", {})
    print(f"tracked by the collector at the last run: {gc_seen.get('tracked')} (frozen {gc_seen.get('frozen')}): "
          f"{gc_seen.get('tracked_by_type')} {gc_seen.get('tracked_by_module')}", flush=True)
    parts = eng["constrained"]["breakdown"]
    print("constrained step breakdown (median ms): " + ", ".join(
        f"{k.removesuffix('_ms')} {v:.3f}" for k, v in parts.items() if k.endswith("_ms"))
        + f"; bitmask buffers allocated in the timed steps: {parts.get('buffers_allocated')}", flush=True)
    emit(result, ns.out)


if __name__ == "__main__":
    main()
