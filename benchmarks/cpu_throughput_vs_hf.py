"""keel vs HuggingFace transformers `generate()` on the CPU: same model, same prompts, same batch size.

    python benchmarks/cpu_throughput_vs_hf.py [--model demo] [--num-prompts 64] [--min-input-len 16]
        [--max-input-len 128] [--min-output-len 64] [--max-output-len 64] [--batch-size 16]
        [--repeats 3] [--out FILE.json]

Both decode greedily in float32. Prompt lengths are drawn uniformly from [min_input_len, max_input_len]
and each request's output length from [min_output_len, max_output_len] (equal bounds: fixed lengths) --
as if each request met its EOS at that point. transformers gets the prompts in batches of `batch_size`
(left-padded, KV cache on: how a user batches `generate()`); a batch runs until its longest request is
done, and only each request's own tokens are counted. keel gets all prompts at once with
`max_num_seqs=batch_size`, each with its own max_tokens, and batches continuously. keel and transformers
alternate `repeats` times in one process and the medians are compared, so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from keel.bench import source_commit
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.engine.sampling_params import SamplingParams


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def make_output_lens(n: int, lo: int, hi: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def keel_run(engine: LLMEngine, prompts: list[list[int]], output_lens: list[int]) -> dict:
    start = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, output_lens)):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        engine.add_request(f"b{i}", {"prompt_token_ids": p}, params)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed}


class HFRunner:
    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        pad = self.model.config.pad_token_id
        self.pad = pad if pad is not None else 0

    def run(self, prompts: list[list[int]], output_lens: list[int], batch_size: int) -> dict:
        start = time.perf_counter()
        tokens = 0
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i : i + batch_size]
            lens = output_lens[i : i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=max(lens),
                    min_new_tokens=max(lens), do_sample=False, pad_token_id=self.pad,
                )
            assert out.shape[1] - width == max(lens)
            tokens += sum(lens)  # tokens past a request's own end are waste, not output
        elapsed = time.perf_counter() - start
        return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-input-len", type=int, default=16)
    ap.add_argument("--max-input-len", type=int, default=128)
    ap.add_argument("--min-output-len", type=int, default=64)
    ap.add_argument("--max-output-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()

    engine = LLMEngine.from_engine_args(
        EngineArgs(model=ns.model, dtype="float32", max_num_seqs=ns.batch_size, skip_tokenizer_init=True,
                   enable_prefix_caching=False)
    )
    path = engine.config.model.model
    vocab = engine.config.model.hf_config.vocab_size
    prompts = make_prompts(ns.num_prompts, ns.min_input_len, ns.max_input_len, vocab)
    output_lens = make_output_lens(ns.num_prompts, ns.min_output_len, ns.max_output_len)
    hf = HFRunner(path)
    keel_run(engine, prompts[:2], [4, 4])  # warm-up both
    hf.run(prompts[:2], [4, 4], 2)
    keel_runs, hf_runs = [], []
    for _ in range(ns.repeats):
        keel_runs.append(keel_run(engine, prompts, output_lens)["output_tokens_per_s"])
        hf_runs.append(hf.run(prompts, output_lens, ns.batch_size)["output_tokens_per_s"])
    keel_tps, hf_tps = statistics.median(keel_runs), statistics.median(hf_runs)
    cfg = engine.config.model.hf_config
    result = {
        "device": f"{platform.machine()} CPU, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": __import__("transformers").__version__,
        "commit": source_commit(Path(__file__).parent),
        "model": ns.model,
        "model_shape": {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size},
        "num_prompts": ns.num_prompts,
        "input_len_range": [ns.min_input_len, ns.max_input_len],
        "output_len_range": [ns.min_output_len, ns.max_output_len],
        "batch_size": ns.batch_size,
        "keel_output_tok_s_runs": keel_runs,
        "hf_output_tok_s_runs": hf_runs,
        "keel_output_tok_s": keel_tps,
        "hf_output_tok_s": hf_tps,
        "speedup_vs_hf": keel_tps / hf_tps,
    }
    print(json.dumps(result, indent=2))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
