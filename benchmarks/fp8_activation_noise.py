"""How far fp8 activation quantization alone moves a deep random model's logprobs (CPU, no GPU needed).

Why: on one DeepSeek-V2-Lite block-fp8 checkpoint, keel and vLLM agreed on the first greedy token of 3 of 4
prompts, and their top tokens' logprobs differed by up to 0.35 (0.03 in bf16 on the same seed;
`h100-vs-vllm-dsv2-fp8-block-ckpt-006b5ec.json`). Is that an error in one engine, or the noise of quantizing every
linear layer's input to e4m3 per 128-group (each engine rounds slightly different pre-quantization values)?

    python benchmarks/fp8_activation_noise.py [--dir DIR] [--experts 4] [--out FILE.json]

Writes `h200_vs_vllm.write_checkpoint`'s block-fp8 DSV2-Lite checkpoint (27 layers, the real widths) with fewer
routed experts so it fits a CPU (default 4 of top-2, one shared; ~1.7 B parameters), then, each in its own
process, for the harness's first 4 round-2 prompts (first two greedy tokens, top-2 logprobs):
  hf          transformers on the dequantized weights, float32 (`h200_vs_vllm.reference_rows`)
  keel        keel's CPU path, float32, activations quantized per 128-group (emulated, as its tests check)
  keel-noact  the same with the activation quantization switched off: the weights' path alone
and each keel row's `reference_gap` against hf.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import h200_vs_vllm as vs  # noqa: E402


def shape(experts: int) -> dict:
    return dict(vs.DSV2_LITE, n_routed_experts=experts, num_experts_per_tok=min(2, experts), n_shared_experts=1)


def write(out: Path, cfg: dict) -> None:
    """`h200_vs_vllm.write_checkpoint`'s block-fp8 DSV2-Lite checkpoint at `cfg`'s shape, drawn on the CPU."""
    vs.DSV2_LITE = cfg
    vs.write_checkpoint(out, "dsv2lite", quantization="fp8-block", shard_bytes=2 << 30, device="cpu")


def run(mode: str, model_dir: str, steps: int) -> dict:
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    ps = vs.prompts(4, vocab, seed=1)
    if mode == "hf":
        return vs.reference_rows(model_dir, ps, steps=steps)
    if mode == "keel-noact":
        import keel_quantization.fp8_math as fp8_math

        fp8_math.fake_quant_per_token_group = lambda x, group: x  # the linear and MoE methods look it up per call
    from keel import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
              max_num_seqs=4, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=2))
    llm.shutdown()
    return {"engine": mode, "top2": [vs.top2(o.outputs[0]) for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/fp8-activation-noise", help="the checkpoint (written if absent)")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run(a.one, a.dir, a.steps)), flush=True)
        return
    out = Path(a.dir)
    if not (out / "model.safetensors.index.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        write(out, shape(a.experts))
        print(f"checkpoint written in {time.perf_counter() - t:.0f} s", flush=True)
    rows = {}
    for mode in ("hf", "keel", "keel-noact"):  # one process each: the models do not share memory
        p = subprocess.run([sys.executable, __file__, "--one", mode, "--dir", a.dir, "--steps", str(a.steps)],
                           capture_output=True, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        rows[mode] = json.loads(lines[-1]) if lines and not p.returncode else {"error": p.stderr[-2000:]}
        print(mode, json.dumps(rows[mode])[:400], flush=True)
    result = {"shape": {k: v for k, v in shape(a.experts).items() if k != "rope_scaling"},
              "commit": os.environ.get("KEEL_COMMIT") or _commit(), "rows": rows,
              "vs_reference": {m: vs.reference_gap(rows[m], rows["hf"]) for m in ("keel", "keel-noact")
                               if "top2" in rows.get(m, {}) and "top2" in rows.get("hf", {})}}
    print(json.dumps(result["vs_reference"]))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


def _commit() -> str | None:
    from keel.bench import source_commit

    return source_commit(Path(__file__).resolve().parent)


if __name__ == "__main__":
    main()
