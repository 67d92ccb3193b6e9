"""The per-step cost of structured outputs' token bitmask at batch 256, against a plain decode step.

    python benchmarks/h200_bitmask.py [--batch 256] [--layers 32] [--out benchmarks/results/h200-bitmask.json]
    python benchmarks/h200_bitmask.py --smoke      # CPU, tiny shapes: checks the script runs

Three numbers, on one device (Llama-3-8B shape, vocab 128256, bf16, random weights):
  1. decode_step_ms: one engine step at `batch` decoding requests (keel.bench.run_latency's time per
     output token: every step emits one token per request), no constraint;
  2. device_ms: what a constrained step adds on the device -- the bitmask's host-to-device copy from
     pinned memory plus `keel.layers.token_bitmask.apply_token_bitmask` on [batch, vocab] float32 logits
     (CUDA events, median);
  3. host_fill_ms: the engine core's `StructuredOutputManager.grammar_bitmask` for `batch` xgrammar
     matchers of a JSON schema (wall clock, median over steps; each matcher then accepts an allowed
     token, so the states move as in decoding). The vocabulary is synthetic (256 byte tokens plus
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
    import xgrammar as xgr
    from keel_structured_output_xgrammar.backend import XGrammarMatcher

    from keel.structured_output.backend import BackendContext
    from keel.structured_output.manager import StructuredOutputManager

    info = synthetic_tokenizer_info(vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=8)
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t
    manager = StructuredOutputManager(lambda: object, lambda: BackendContext(None, vocab, 2), vocab)  # type: ignore
    grammars = [XGrammarMatcher(xgr.GrammarMatcher(compiled)) for _ in range(batch)]
    ids = [f"r{i}" for i in range(batch)]
    rng = random.Random(1)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = manager.grammar_bitmask(ids, grammars)
        times.append((time.perf_counter() - t) * 1e3)
        allowed = out.bitmask  # [batch, words]
        for i, g in enumerate(grammars):
            words = torch.nonzero(allowed[i]).flatten().tolist()
            if not words or g.is_terminated():
                continue
            w = rng.choice(words)
            bits = [b for b in range(32) if (int(allowed[i, w]) >> b) & 1]
            g.accept_tokens([w * 32 + rng.choice(bits)])
    manager.shutdown()
    return {"host_fill_ms": statistics.median(times), "compile_s": compile_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--fill-steps", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model and batch: the script runs")
    parser.add_argument("--out", default="benchmarks/results/h200-bitmask.json")
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
    print(f"host fill of {ns.batch} xgrammar matchers: {result['host_fill_ms']:.3f} ms "
          f"(schema compile {result['compile_s']:.2f} s)", flush=True)
    result["decode_step_ms"] = decode_step_ms(ns, device)
    step = result["decode_step_ms"]
    result["device_fraction"] = result["device_ms"] / step
    result["total_fraction"] = (result["device_ms"] + result["host_fill_ms"]) / step
    print(f"plain decode step at batch {ns.batch}: {step:.3f} ms; bitmask device cost {100 * result['device_fraction']:.2f}%"
          f", device + host fill {100 * result['total_fraction']:.2f}% (target < 5%)", flush=True)
    if not ns.smoke:
        Path(ns.out).write_text(json.dumps(result, indent=2))
        print("wrote", ns.out)


if __name__ == "__main__":
    main()
