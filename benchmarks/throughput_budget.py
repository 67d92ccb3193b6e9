"""Where the side-by-side throughput workload's time goes, step by step, and what a target asks of each step.

    python benchmarks/throughput_budget.py [--out benchmarks/results/throughput-budget.json]

CPU only, no model. keel's own `Scheduler` runs issue 11's workload (1000 prompts of 128 tokens, 128 out,
ignore_eos, max_num_seqs 256, max_num_batched_tokens 8192) against a stand-in runner: the step census, each
step's decode count and prefill tokens. Each step is then priced from a measured step profile of one device
(`h200_step_profile.py`):
- a decode step of b requests: the profile's wall at batch b, linear between its batch-1 and batch-256 walls
  (at batch 256 every routed expert is read already; the census's decode steps are 224-256 requests);
- a step with prefill tokens: its decodes' price plus the profile's 8192-token prefill step times its share
  of 8192 tokens (GPU time where the profile's host was not yet hidden; see `prefill_ms`).
The priced round is set beside the harness's measured throughput from a session near the profile's commit
(`CASES`: both figures copied from the result files named; the harness's round runs a few percent slower than
its priced steps, and the step times below are scaled by that ratio), and the target (1.2x vLLM for DeepSeek,
1.3x for Llama) is turned into step times: the batch-256 decode step it asks for with the prefill steps as
measured, and with the prefill steps at their floor (`throughput_floor.py`, H200 only).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the workload, as the floors describe it (one definition of the harness's numbers)
from throughput_floor import BATCHED, NUM_PROMPTS, OUTPUT, PROMPT, RESULTS, SEQS  # noqa: E402

# name -> the step profile, its prefill figure (wall where the host was hidden, else GPU time), the harness's
# keel and vLLM rounds (out tok/s) from a session near the profile's commit, the target ratio, and the model
# whose H200 floors (throughput-floor.json) apply (None: no floor measured on that device)
CASES = {
    "dsv2lite-h200": {
        "profile": "h200-step-profile-dsv2lite-8f461cc.json", "prefill": "total_gpu_ms",  # host gap since fixed
        "keel": [15999, 16673], "vllm": [16659, 16193], "harness": "h200-vs-vllm.json (keel 8f461cc)",
        "target": 1.2, "floors": "dsv2lite"},
    "dsv2lite-h100": {
        "profile": "h100-step-profile-dsv2lite-moe-sum-f183f15.json", "prefill": "total_gpu_ms",
        "keel": [14858, 15036], "vllm": [14093, 13694], "harness": "h100-vs-vllm-3adf255.json (keel 3adf255)",
        "target": 1.2, "floors": None},
    "llama8b-h200": {
        "profile": "h200-step-profile-llama8b-148f8e5.json", "prefill": "wall_ms_median",
        "keel": [15984, 15943], "vllm": [15201, 15155], "harness": "h200-vs-vllm.json (keel 8f461cc)",
        "target": 1.3, "floors": "llama8b"},
}


def census(max_num_seqs: int = SEQS, seed: int = 0) -> list[tuple[int, int]]:
    """(decoding requests, prefill tokens) of every step keel's scheduler runs for the workload."""
    import torch

    from keel.engine.request import EngineCoreRequest
    from keel.engine.sampling_params import SamplingParams
    from keel.engine.scheduler import Scheduler
    from keel.engine.scheduler_output import ModelRunnerOutput
    from keel.kv_cache.manager import KVCacheManager
    from keel.kv_cache.spec import FullAttentionSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=4, dtype=torch.float32)
    blocks = max_num_seqs * (PROMPT + OUTPUT) // 16 * 2  # room for every running request: no preemption
    sched = Scheduler(KVCacheManager(spec, num_blocks=blocks, enable_caching=True), max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=BATCHED, max_model_len=4096)
    rng = random.Random(seed)  # distinct prompts: no prefix-cache hits, as in the harness
    for i in range(NUM_PROMPTS):
        sched.add_request(EngineCoreRequest(f"r{i}", [rng.randrange(1, 100_000) for _ in range(PROMPT)],
                                            SamplingParams(max_tokens=OUTPUT, ignore_eos=True), eos_token_id=None,
                                            seed=0, arrival_time=float(i)), OUTPUT)
    steps = []
    while sched.waiting or sched.running:
        out = sched.schedule()
        n = out.num_scheduled_tokens
        ids = list(n)
        # a request samples once its prompt is done (a chunk that ends the prompt, or a decode); schedule()
        # has already counted this step's tokens as computed
        done = [sched.requests[r].num_computed_tokens >= sched.requests[r].num_prompt_tokens for r in ids]
        steps.append((sum(1 for r, d in zip(ids, done) if d and n[r] == 1), sum(v for v in n.values() if v > 1)))
        sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7] if d else []
                                                                                        for d in done]))
    return steps


def price(steps: list[tuple[int, int]], b1_ms: float, b256_ms: float, prefill_ms: float) -> dict:
    """Seconds of the round: decode steps by batch (linear in b between the measured walls), prefill tokens at
    the 8192-token step's price per token."""
    def decode(b: int) -> float:
        return b1_ms + (b256_ms - b1_ms) * (b - 1) / 255 if b else 0.0

    dec = sum(decode(b) for b, p in steps if not p)
    mixed = sum(decode(b) + prefill_ms * p / BATCHED for b, p in steps if p)
    return {"decode_steps_s": dec / 1e3, "prefill_steps_s": mixed / 1e3, "round_s": (dec + mixed) / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(RESULTS / "throughput-budget.json"))
    ns = ap.parse_args()
    steps = census()
    pure = [b for b, p in steps if not p]
    with_prefill = [(b, p) for b, p in steps if p]
    prefill_steps = sum(p for _, p in with_prefill) / BATCHED  # the prompt tokens in 8192-token steps' worth
    out = {"workload": {"num_prompts": NUM_PROMPTS, "prompt": PROMPT, "output": OUTPUT, "max_num_seqs": SEQS,
                        "max_num_batched_tokens": BATCHED},
           "census": {"steps": len(steps), "decode_steps": len(pure),
                      "decode_steps_at_256": sum(1 for b in pure if b == SEQS),
                      "decode_steps_under_224": sum(1 for b in pure if b < 224),
                      "steps_with_prefill": len(with_prefill),
                      "prefill_tokens": round(prefill_steps * BATCHED),
                      "ideal_steps": -(-NUM_PROMPTS // SEQS) * OUTPUT},
           "cases": {}}
    print(json.dumps(out["census"]))
    gen = NUM_PROMPTS * OUTPUT
    floors = json.loads((RESULTS / "throughput-floor.json").read_text())["models"]
    decoding = [b for b, _ in steps if b]  # steps that price decodes (all but the first, prefill-only one)
    n_dec = len(decoding)
    frac = (sum(decoding) / n_dec - 1) / 255  # the mean step's place on the batch-1 .. batch-256 line
    for name, c in CASES.items():
        prof = json.loads((RESULTS / c["profile"]).read_text())
        prof = prof.get("new", prof)  # an A/B file: its "new" side
        walls = {d["batch"]: d["step_wall_ms_median"] for d in prof["decode"]}
        lo, b256 = min(walls), walls[256]
        # the line through the smallest batch's wall and batch 256's, at batch 1 (Llama's profile has 64 and 256)
        b1 = walls[lo] - (b256 - walls[lo]) * (lo - 1) / (256 - lo)
        prefill = prof["prefill"][c["prefill"]]
        p = price(steps, b1, b256, prefill)
        predicted = gen / p["round_s"]
        target = c["target"] * max(c["vllm"])  # the target in the faster of vLLM's rounds
        # the harness's round takes longer than the priced steps (host work, the engine's own ramp): the target's
        # seconds are scaled by the measured / priced ratio, so the step times asked for are the engine's walls
        calib = max(c["keel"]) / predicted
        target_s = gen / target * calib
        share_prefill = prefill * prefill_steps / 1e3  # the prefill tokens' seconds

        def decode_needed(prefill_s: float) -> float:
            """The batch-256 decode wall the target asks for (batch-1 wall kept) beside `prefill_s` of prefill."""
            per_step = (target_s - prefill_s) * 1e3 / n_dec  # mean decode price a step may take
            return (per_step - b1 * (1 - frac)) / frac

        fl = floors[c["floors"]] if c["floors"] else None
        row = {"profile": c["profile"], "harness": c["harness"], "b1_wall_ms": round(b1, 3),
               "b256_wall_ms": b256, "prefill_8192_ms": prefill, "priced": {k: round(v, 3) for k, v in p.items()},
               "prefill_tokens_share_s": round(share_prefill, 3),
               "predicted_out_tok_s": round(predicted), "measured_keel_out_tok_s": c["keel"],
               "predicted_over_measured": round(predicted / max(c["keel"]), 3),
               "target": f"{c['target']}x vLLM's faster round, {round(target)} out tok/s, {round(target_s, 2)} s",
               "b256_decode_ms_needed_prefill_as_measured": round(decode_needed(share_prefill), 2)}
        if fl:
            floor_prefill_s = fl["prefill_step_ms"] * prefill_steps / 1e3
            row.update({"b256_decode_ms_needed_prefill_at_floor": round(decode_needed(floor_prefill_s), 2),
                        "b256_decode_floor_ms": round(fl["decode_step_ms"], 2),
                        "prefill_8192_floor_ms": round(fl["prefill_step_ms"], 2)})
        out["cases"][name] = row
        print(name, json.dumps(row))
    Path(ns.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
