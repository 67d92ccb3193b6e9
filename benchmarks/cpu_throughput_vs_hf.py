"""keel vs HuggingFace transformers `generate()` on the CPU: same model, same prompts, same batch.

    python benchmarks/cpu_throughput_vs_hf.py [--model demo] [--num-prompts 32] [--input-len 64]
        [--output-len 64] [--batch-size 32] [--out benchmarks/results/cpu-throughput.json]

Both run greedy decoding of exactly `output_len` tokens per prompt in float32. transformers gets the
prompts in batches of `batch_size` (left-padded, KV cache on, as a user would call it); keel gets them
all at once and batches continuously. The ratio is measured in one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

import torch

from keel.bench import random_prompts, run_throughput
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine


def hf_throughput(path: str, prompts: list[list[int]], output_len: int, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def run(batch):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                do_sample=False, pad_token_id=pad,
            )
        return (out.shape[1] - width) * len(batch)

    run(prompts[:2])  # warm-up
    start = time.perf_counter()
    tokens = sum(run(prompts[i : i + batch_size]) for i in range(0, len(prompts), batch_size))
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()

    engine = LLMEngine.from_engine_args(
        EngineArgs(model=ns.model, dtype="float32", max_num_seqs=ns.batch_size, skip_tokenizer_init=True)
    )
    path = engine.config.model.model
    vocab = engine.config.model.hf_config.vocab_size
    prompts = random_prompts(ns.num_prompts, ns.input_len, vocab, seed=0)
    run_throughput(engine, prompts[:2], 4)  # warm-up
    keel = run_throughput(engine, prompts, ns.output_len)
    hf = hf_throughput(path, prompts, ns.output_len, ns.batch_size)
    result = {
        "device": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "model": ns.model,
        "num_prompts": ns.num_prompts,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "batch_size": ns.batch_size,
        "keel_output_tok_s": keel["output_tokens_per_s"],
        "hf_output_tok_s": hf["output_tokens_per_s"],
        "speedup_vs_hf": keel["output_tokens_per_s"] / hf["output_tokens_per_s"],
    }
    print(json.dumps(result, indent=2))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
