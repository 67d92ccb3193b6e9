"""Where DSV2-Lite offline throughput goes: the same 256 x 128/128 run under variants, one device call.

    python benchmarks/h200_dsv2lite_throughput.py [--out FILE.json] [--num-prompts 256]

Each variant is a fresh dummy-weight engine (profile `cuda`, as benchmarks/h200_dsv2lite.py builds it);
the run is measured twice (cold: the first run after engine start; warm: other prompts of the same shape,
so no prefix-cache hits), and per engine step the wall time is split by the kind
of step (with prefill tokens, or pure decode). Variants: the default engine, the same engine with
synchronous scheduling, and the fused MoE with the fixed tiles used before tuning (16x64x32).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch

_here = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("h200_dsv2lite", _here / "h200_dsv2lite.py")
_ds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ds)


def timed_run(engine, prompts, output_len: int) -> dict:
    """run_throughput, plus the wall time of each engine step split by whether it scheduled prefill."""
    from keel import SamplingParams

    core = engine.core
    sched = core.scheduler
    kinds = {"prefill": [0, 0.0], "decode": [0, 0.0]}
    original = sched.schedule

    def schedule():
        out = original()
        schedule.last_prefill = out.total_num_scheduled_tokens > len(out.num_scheduled_tokens)
        return out

    schedule.last_prefill = False
    sched.schedule = schedule
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"t{time.monotonic_ns()}-{i}", {"prompt_token_ids": p}, params)
    tokens = 0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        kind = kinds["prefill" if schedule.last_prefill else "decode"]
        kind[0] += 1
        kind[1] += time.perf_counter() - t0
        tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
    elapsed = time.perf_counter() - start
    sched.schedule = original
    return {"elapsed_s": elapsed, "output_tokens_per_s": tokens / elapsed,
            "steps": {k: {"count": n, "s": s} for k, (n, s) in kinds.items()}}


def variant(name: str, shape: dict, prompts, patch=None) -> dict:
    from keel_kernels_triton.fused_moe import grouped_gemm

    from keel.bench import random_prompts

    original = grouped_gemm.get_moe_tile_configs
    if patch is not None:
        grouped_gemm.get_moe_tile_configs = patch
    try:
        _, model_dir = _ds.write_config(shape)
        engine = _ds.make_engine(model_dir, eager=False)
        others = [random_prompts(len(prompts), 128, shape["vocab_size"], seed=s) for s in (1, 2)]
        out = {"cold": timed_run(engine, prompts, 128), "warm": timed_run(engine, others[0], 128)}
        if name == "default":
            engine.core.async_scheduling = engine.core.scheduler.async_scheduling = False
            out["warm_sync_scheduling"] = timed_run(engine, others[1], 128)
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()
    finally:
        grouped_gemm.get_moe_tile_configs = original
    print(name, json.dumps(out), flush=True)
    return out


def hf_weights_variant(shape: dict, prompts) -> dict:
    """As h200_dsv2lite.py measures: transformers' model resident on the GPU and its weights loaded into
    the engine; then the same after transformers' model is freed (allocator headroom vs weights)."""
    from transformers import AutoModelForCausalLM

    from keel.bench import random_prompts

    cfg, model_dir = _ds.write_config(shape)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    engine = _ds.make_engine(model_dir, eager=False)
    runner = engine.core.worker.runner
    runner.model.load_weights(_ds.per_expert(hf.state_dict(), shape))
    runner.model.process_weights_after_loading()
    engine.core.scheduler.kv.reset_prefix_cache()
    others = [random_prompts(len(prompts), 128, shape["vocab_size"], seed=s) for s in (1, 2)]
    out = {"cold_hf_resident": timed_run(engine, prompts, 128),
           "warm_hf_resident": timed_run(engine, others[0], 128)}
    del hf
    torch.cuda.empty_cache()
    out["warm_hf_freed"] = timed_run(engine, others[1], 128)
    out["free_memory_gib"] = torch.cuda.mem_get_info()[0] / 2**30
    engine.shutdown()
    print("hf_weights", json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/h200-dsv2lite-throughput.json")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--default-only", action="store_true", help="only the default engine's variants")
    ap.add_argument("--hf-weights-only", action="store_true", help="only the transformers-weights variant")
    ns = ap.parse_args()
    from keel_kernels_triton.fused_moe.tile_config import MoETileConfig

    from keel.bench import random_prompts

    shape = dict(_ds.DSV2_LITE)
    prompts = random_prompts(ns.num_prompts, 128, shape["vocab_size"], seed=0)
    legacy = MoETileConfig(16, 64, 32, 4, 3)
    result = {"device": torch.cuda.get_device_name(), "num_prompts": ns.num_prompts, "variants": {}}
    if ns.hf_weights_only:
        result["variants"]["hf_weights"] = hf_weights_variant(shape, prompts)
        Path(ns.out).write_text(json.dumps(result, indent=2))
        return
    result["variants"]["default"] = variant("default", shape, prompts)
    if not ns.default_only:
        result["variants"]["legacy_moe_tiles"] = variant("legacy_moe_tiles", shape, prompts,
                                                         patch=lambda *a, **k: (legacy, legacy))
    Path(ns.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
