"""The per-step cost of structured outputs' token bitmask at batch 256, against a plain decode step.

    python benchmarks/h200_bitmask.py --out benchmarks/results/h200-bitmask.json [--batch 256] [--layers 32]
    python benchmarks/h200_bitmask.py --smoke [--out x.json]   # CPU, tiny shapes: checks the script runs

Needs the core, plugins models-llama / attention-flash / platform-cuda (the cuda profile's plugins) and,
for the host fill, xgrammar (with its apache-tvm-ffi); without xgrammar the host fill is reported as not
measured and the device numbers still come.

Three numbers, on one device (Llama-3-8B shape, vocab 128256, bf16, random weights):
  1. decode_step_ms: one engine step at `batch` decoding requests (keel.bench.run_latency's time per
     output token: every step emits one token per request), no constraint;
  2. device_ms: what a constrained step adds on the device -- the bitmask's host-to-device copy from
     pinned memory plus `keel.layers.token_bitmask.apply_token_bitmask` on [batch, vocab] float32 logits
     (CUDA events, median);
  3. host_fill_ms: the engine core's `StructuredOutputManager.grammar_bitmask` for `batch` xgrammar
     matchers of a JSON schema through the xgrammar backend (xgrammar's threaded batch fill; wall clock,
     median over steps; each matcher then accepts an allowed token, so the states move as in decoding),
     and host_fill_sequential_ms, the same rows filled one matcher at a time. The vocabulary is synthetic (256 byte tokens plus
     generated words): xgrammar's fill cost depends on the vocabulary size and the grammar state.
The report states device_ms and (device_ms + host_fill_ms) as fractions of decode_step_ms (target:
< 5%). With async scheduling the host fill of step N+1 overlaps the device's step N for unconstrained
work, but a constrained request's fill sits between its steps, so the sum is the honest bound.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
             "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1,
             "eos_token_id": 2}
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"]}}, "required": ["name", "age", "tags", "address"]}


def decode_step_ms(ns, device: str) -> float:
    from transformers import LlamaConfig

    from keel.bench import run_latency
    from keel.config import EngineArgs
    from keel.engine.llm_engine import LLMEngine

    shape = {**LLAMA3_8B, "num_hidden_layers": ns.layers}
    if ns.smoke:
        shape.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    cfg = LlamaConfig(**shape)
    cfg.architectures = ["LlamaForCausalLM"]
    model_dir = Path(tempfile.mkdtemp()) / "llama8b-shape"
    cfg.save_pretrained(model_dir)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(model_dir), profile="cpu" if device == "cpu" else "cuda", load_format="dummy",
        # The plain step needs no structured-output backend: the profile's kernels and Llama only.
        plugins=["platform-cpu", "attention-torch", "models-llama"] if device == "cpu" else
        ["platform-cuda", "attention-flash", "attention-torch", "kernels-triton", "models-llama"],
        dtype="float32" if device == "cpu" else "bfloat16", skip_tokenizer_init=True, max_model_len=512,
        max_num_seqs=ns.batch, max_num_batched_tokens=8192,
        **({} if device == "cpu" else {"gpu_memory_utilization": 0.6})))
    lat = run_latency(engine, ns.batch, 128, ns.output_len, ns.iters, cfg.vocab_size)
    engine.shutdown()
    del engine
    return lat["time_per_output_token_ms"]


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


def device_ms(batch: int, vocab: int, device: str) -> float:
    from keel.layers.token_bitmask import apply_token_bitmask
    from keel.structured_output.backend import bitmask_width

    logits = torch.randn(batch, vocab, dtype=torch.float32, device=device)
    host = torch.randint(-(2**31), 2**31 - 1, (batch, bitmask_width(vocab)), dtype=torch.int32,
                         pin_memory=device != "cpu")
    rows = torch.arange(batch, device=device)

    def step():
        bitmask = host.to(device, non_blocking=True)
        apply_token_bitmask(logits, bitmask, rows)

    return _median_ms(step, device)


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


def host_fill_ms(batch: int, vocab: int, steps: int) -> dict:
    try:
        import xgrammar as xgr
        from keel_structured_output_xgrammar.backend import FILL_THREADS, XGrammarBackend, batch_matcher
    except ImportError as exc:
        return {"host_fill_ms": None, "host_fill_error": f"xgrammar is not importable: {exc}"}

    from keel.structured_output.backend import BackendContext
    from keel.structured_output.manager import StructuredOutputManager
    from keel.structured_output.params import StructuredOutputsParams

    info = synthetic_tokenizer_info(vocab)

    class SyntheticVocabBackend(XGrammarBackend):
        """The engine's xgrammar backend over the synthetic vocabulary (no Hugging Face tokenizer)."""

        def __init__(self, ctx: BackendContext) -> None:
            self.info = info
            self.compiler = xgr.GrammarCompiler(info, max_threads=8)
            self.batch = batch_matcher()

    manager = StructuredOutputManager(lambda: SyntheticVocabBackend, lambda: BackendContext(None, vocab, 2), vocab)
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
            "fill_threads": FILL_THREADS,
            "compile_s": compile_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--fill-steps", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model and batch: the script runs")
    parser.add_argument("--out", default=None, help="write the results as JSON here (also printed)")
    ns = parser.parse_args()
    device = "cpu" if ns.smoke else "cuda"
    if ns.smoke:
        ns.batch, ns.layers, ns.output_len, ns.iters, ns.fill_steps = 8, 1, 8, 1, 5
    vocab = LLAMA3_8B["vocab_size"]
    result = {"batch": ns.batch, "vocab": vocab, "layers": ns.layers, "device":
              "cpu" if ns.smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
              "python": platform.python_version(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       check=False).stdout.strip()}
    result["device_ms"] = device_ms(ns.batch, vocab, device)
    print(f"bitmask copy + apply on the device: {result['device_ms']:.3f} ms", flush=True)
    result.update(host_fill_ms(ns.batch, vocab, ns.fill_steps))
    if result["host_fill_ms"] is None:
        print(f"host fill not measured: {result['host_fill_error']}", flush=True)
    else:
        print(f"host fill of {ns.batch} xgrammar matchers: {result['host_fill_ms']:.3f} ms batched, "
              f"{result['host_fill_sequential_ms']:.3f} ms one by one (schema compile {result['compile_s']:.2f} s)",
              flush=True)
    result["decode_step_ms"] = decode_step_ms(ns, device)
    step = result["decode_step_ms"]
    result["device_fraction"] = result["device_ms"] / step
    fill = result["host_fill_ms"]
    result["total_fraction"] = None if fill is None else (result["device_ms"] + fill) / step
    total = "not measured" if fill is None else f"{100 * result['total_fraction']:.2f}%"
    print(f"plain decode step at batch {ns.batch}: {step:.3f} ms; bitmask device cost {100 * result['device_fraction']:.2f}%"
          f", device + host fill {total} (target < 5%)", flush=True)
    print(json.dumps(result, indent=2))
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")
        print("wrote", ns.out)


if __name__ == "__main__":
    main()
