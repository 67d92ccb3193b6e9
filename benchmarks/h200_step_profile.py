"""Where a big engine step's GPU time goes: per-kernel CUPTI profile of steady-state decode steps at a
batch of B running requests (CUDA graphs replayed), and of one full prefill step, for the shapes of the
keel-vs-vLLM comparison (benchmarks/h200_vs_vllm.py), with the same engine limits.

    python benchmarks/h200_step_profile.py --arch dsv2lite|llama8b [--model-dir DIR] [--batch 256,64]
        [--out FILE.json] [--disable-shared-experts-fusion] [--quantization-config JSON | --quantization-case CASE]

Per batch: the wall time of `engine.step()` (median of 30 consecutive decode steps, every request past
its prompt), the GPU time the profiler saw per step (kernels, graph replays included), their difference
(host time not hidden behind the GPU), kernels per category and the top kernels. At the `--mixed`
batches also a window of 3 steps in which prompts filling the rest of the token budget arrive beside
the decodes (the mixed step runs eagerly): its wall and GPU time. Dummy weights unless
`--model-dir` names a checkpoint (for an MoE model the router then reads the same experts as vLLM did).
With PDL on (the default) a kernel's profiled duration includes its wait for the kernel before it, so the
per-kernel times and their sum overstate, and "host_not_hidden_ms" goes negative: attribute time with
`--no-pdl`, compare changes by the wall times. (A moe_sum change predicted from PDL-inflated per-launch times
moved nothing: h100-step-profile-dsv2lite-moe-sum-f183f15.json.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import h200_vs_vllm as vs
from h200_dsv2lite import _guarded, profile_kernels

from keel.bench import source_commit


def make_engine(model_dir: str, dummy: bool, **engine_args):
    from keel.config import EngineArgs
    from keel.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs(
        model=model_dir, profile=os.environ.get("KEEL_PROFILE", "cuda"), dtype="bfloat16",
        load_format="dummy" if dummy else "auto", skip_tokenizer_init=True, seed=0, **vs.LIMITS, **engine_args))


def decode_profile(engine, batch: int, vocab: int, seed: int, mixed_window: bool = False) -> dict:
    from keel.engine.sampling_params import SamplingParams

    sched = engine.core.scheduler
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i, p in enumerate(vs.prompts(batch, vocab, seed)):
        engine.add_request(f"d{seed}-{i}", {"prompt_token_ids": p}, params)
    steps = 0
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
        steps += 1
    for _ in range(4):  # past the step that samples the last prompt's first token
        engine.step()
    walls = []
    for _ in range(30):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    prof = profile_kernels(engine.step, steps=10)
    wall_ms = statistics.median(walls) * 1e3
    mixed = _guarded(lambda: mixed_profile(engine, vocab, seed)) if mixed_window else None
    for r in list(sched.running):
        engine.abort_request(r.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return {"batch": batch, "running": batch, "prefill_steps": steps, "step_wall_ms_median": round(wall_ms, 3),
            "step_wall_ms_min": round(min(walls) * 1e3, 3), "tok_s_at_this_batch": round(batch / wall_ms * 1e3),
            "gpu_ms_per_step": round(prof.get("total_gpu_ms", 0.0), 3),
            "host_not_hidden_ms": round(wall_ms - prof.get("total_gpu_ms", 0.0), 3), **prof,
            **({"mixed": mixed} if mixed is not None else {})}


def mixed_profile(engine, vocab: int, seed: int, window: int = 3) -> dict:
    """Mixed steps beside the running decodes: prompts filling the rest of the token budget arrive
    and `window` engine steps run (with async scheduling: the mixed step, the decode steps around it).
    Wall and GPU time per window, so host time a mixed step does not hide shows as their difference."""
    import random

    from keel.engine.sampling_params import SamplingParams

    sched = engine.core.scheduler
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    length = vs.LIMITS["max_num_batched_tokens"] - len(sched.running)
    # as few prompts as max_model_len allows (each leaves room for its one output token)
    parts = -(-length // (vs.LIMITS["max_model_len"] - 1))
    sizes = [length // parts + (i < length % parts) for i in range(parts)]
    rng = random.Random(seed)
    windows = [[[rng.randrange(100, vocab - 100) for _ in range(n)] for n in sizes]
               for _ in range(6)]  # 3 timed, 1 warm-up, 2 profiled
    state = {"k": 0}

    def one_window():
        state["k"] += 1
        for i, prompt in enumerate(windows[state["k"] - 1]):
            engine.add_request(f"m{seed}-{state['k']}-{i}", {"prompt_token_ids": prompt}, params)
        for _ in range(window):
            engine.step()

    wall_ms, prof = _timed_and_profiled(one_window)
    return {"prompt_tokens": sizes, "decodes": len(sched.running), "window_steps": window,
            "window_wall_ms_median": round(wall_ms, 3), "window_gpu_ms": round(prof.get("total_gpu_ms", 0.0), 3),
            "host_not_hidden_ms": round(wall_ms - prof.get("total_gpu_ms", 0.0), 3),
            "num_kernels": prof.get("num_kernels"), "categories": prof.get("categories")}


def prefill_profile(engine, vocab: int, host: bool = False) -> dict:
    """One step scheduling max_num_batched_tokens prompt tokens (64 prompts of 128); `host`: with `host_profile`."""
    from keel.engine.sampling_params import SamplingParams

    n = vs.LIMITS["max_num_batched_tokens"] // vs.PROMPT_LEN
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    state = {"k": 0}

    def one_prefill_step():
        state["k"] += 1
        for i, p in enumerate(vs.prompts(n, vocab, 1000 + state["k"])):
            engine.add_request(f"p{state['k']}-{i}", {"prompt_token_ids": p}, params)
        engine.step()
        while engine.has_unfinished_requests():
            engine.step()

    wall_ms, prof = _timed_and_profiled(one_prefill_step)
    out = {"tokens": n * vs.PROMPT_LEN, "wall_ms_median": round(wall_ms, 2), **prof}
    if host:
        out["host"] = _guarded(lambda: host_profile(engine, one_prefill_step))
    return out


def host_profile(engine, fn, top: int = 25) -> dict:
    """Where a call's host time goes: its wall and this process's CPU time (CPU well under wall: the host
    waits on the device; about equal: the host is the bound), the wall of each `engine.step()` in it, and a
    cProfile top list (by own and by cumulative time) of one more call."""
    import cProfile
    import io
    import pstats

    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    steps = []
    step = engine.step

    def timed_step():
        t = time.perf_counter()
        try:
            return step()
        finally:
            steps.append(round((time.perf_counter() - t) * 1e3, 2))

    engine.step = timed_step
    try:
        sync()
        t, c = time.perf_counter(), time.process_time()
        fn()
        sync()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        step_walls = list(steps)
        prof = cProfile.Profile()
        prof.enable()
        fn()
        sync()
        prof.disable()
    finally:
        engine.step = step
    lists = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(key).print_stats(top)  # no machine's paths
        lists[key] = buf.getvalue().splitlines()[-top - 2:]
    return {"wall_ms": round(wall * 1e3, 2), "cpu_ms": round(cpu * 1e3, 2), "step_walls_ms": step_walls,
            "cprofile_by_tottime": lists["tottime"], "cprofile_by_cumulative": lists["cumulative"]}


def _timed_and_profiled(fn, repeats: int = 3, profiled: int = 2) -> tuple[float, dict]:
    """(median wall ms of `repeats` calls of `fn`, the kernel profile of `profiled` more calls)."""
    walls = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t)
    return statistics.median(walls) * 1e3, profile_kernels(fn, steps=profiled)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=["llama8b", "dsv2lite"], default="dsv2lite")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--batch", default="256,64")
    ap.add_argument("--mixed", default="256",
                    help="decode batches beside which mixed steps (prompts filling the token budget) are timed")
    ap.add_argument("--out", default=None)
    ap.add_argument("--disable-shared-experts-fusion", action="store_true",
                    help="DeepSeek: the shared MLP runs on its own (the engine argument of that name)")
    ap.add_argument("--quantization-config", default=None, metavar="JSON",
                    help="dummy weights in a quantized checkpoint's layout: this `quantization_config` goes into "
                         "config.json (e.g. one of h200_quant.py's cases)")
    ap.add_argument("--quantization-case", default=None, metavar="CASE",
                    help="the quantization_config of one of h200_quant.py's cases (instead of the JSON)")
    ap.add_argument("--no-fuse-qkv-a", action="store_true",
                    help="DeepSeek: keep MLA's q and kv_a projections two GEMMs (what the build did before "
                         "fused_qkv_a_proj; keel_models_deepseek.attention.fuse_qkv_a), to measure the fusion")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch the kernel plugins' kernels without programmatic dependent launch (to measure it)")
    ap.add_argument("--no-pdl-quant", action="store_true",
                    help="the quantization plugin's kernels without programmatic dependent launch "
                         "(keel_quantization.pdl; --no-pdl implies it)")
    ap.add_argument("--host-prefill", action="store_true",
                    help="also time the prefill step's host side: CPU vs wall time, each engine.step's wall, and "
                         "a cProfile top list (why a step's wall exceeds its GPU time)")
    ap.add_argument("--plans", default=None, metavar="SMALL_M_JSON",
                    help="the quantized decode GEMMs take a small-m sweep's plans (h200_quant_small_m.py's result) "
                         "over the shipped tables, for the families it swept")
    ap.add_argument("--max-num-seqs", type=int, default=vs.LIMITS["max_num_seqs"],
                    help="the engine's max_num_seqs (default: issue 11's 256; 1024 to profile issue 12's fp8 "
                         "throughput batch), recorded in the result's limits")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    a = ap.parse_args()
    vs.LIMITS["max_num_seqs"] = a.max_num_seqs
    if a.kv_cache_dtype != "auto":  # only when asked, so earlier result files' limits read the same
        vs.LIMITS["kv_cache_dtype"] = a.kv_cache_dtype
    used_plans = "shipped"
    if a.plans:  # before any layer runs: plans are cached per shape
        from h200_quant_small_m import use_swept_plans  # benchmarks/ is on sys.path when this script runs

        used_plans = use_swept_plans(json.loads(Path(a.plans).read_text()))
    if a.no_pdl:
        from keel_attention_flash import pdl as flash_pdl
        from keel_kernels_triton import pdl as triton_pdl

        flash_pdl.ENABLED = triton_pdl.ENABLED = False
    from keel_quantization import pdl as quant_pdl

    if a.no_pdl or a.no_pdl_quant:
        quant_pdl.ENABLED = False
    if a.quantization_case:
        from h200_quant import CASES  # benchmarks/ is on sys.path when this script runs

        arch, _, config, _, _ = CASES[a.quantization_case]
        if a.quantization_config or {"llama": "llama8b", "deepseek_v2": "dsv2lite"}[arch] != a.arch:
            raise SystemExit(f"--quantization-case {a.quantization_case} is a {arch} case, and replaces "
                             "--quantization-config")
        a.quantization_config = json.dumps(config)
    if a.no_fuse_qkv_a:  # before the engine builds the model (in this process)
        from keel_models_deepseek import attention as ds_attention, deepseek_v2 as ds_v2

        ds_attention.fuse_qkv_a = ds_v2.fuse_qkv_a = lambda config, build: False
    mixed = {int(x) for x in a.mixed.split(",") if x}
    model_dir = a.model_dir
    if model_dir is None:
        model_dir = tempfile.mkdtemp()
        vs.write_config(Path(model_dir), a.arch)
    if a.quantization_config:
        if a.model_dir is not None:
            raise SystemExit("--quantization-config describes dummy weights; a checkpoint brings its own")
        cfg_path = Path(model_dir, "config.json")
        cfg = json.loads(cfg_path.read_text())
        cfg_path.write_text(json.dumps({**cfg, "quantization_config": json.loads(a.quantization_config)}))
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    t = time.perf_counter()
    extra = {"disable_shared_experts_fusion": True} if a.disable_shared_experts_fusion else {}
    engine = make_engine(model_dir, dummy=a.model_dir is None, **extra)
    result = {"arch": a.arch, "weights": "dummy" if a.model_dir is None else "checkpoint", **extra,
              "pdl": not a.no_pdl, "pdl_quant": quant_pdl.ENABLED, "small_m_plans": used_plans,
              # with PDL a kernel starts during the one before and its profiled duration includes its wait
              # (griddepcontrol.wait): per-kernel ms and their sum overstate; attribute with --no-pdl
              "kernel_ms_include_pdl_waits": not a.no_pdl, "fuse_qkv_a": not a.no_fuse_qkv_a,
              "quantization_config": json.loads(a.quantization_config) if a.quantization_config else None,
              "limits": vs.LIMITS, "commit": source_commit(Path(__file__).parent) or "?",
              "init_s": round(time.perf_counter() - t, 1), "versions": vs.versions("keel"), "decode": []}
    try:
        for i, b in enumerate(int(x) for x in a.batch.split(",")):
            result["decode"].append(decode_profile(engine, b, vocab, seed=500 + i, mixed_window=b in mixed))
            print(json.dumps({k: v for k, v in result["decode"][-1].items() if k != "top_kernels"}), flush=True)
        result["prefill"] = prefill_profile(engine, vocab, host=a.host_prefill)
    finally:
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=1))
        engine.shutdown()
    print(json.dumps({"prefill_wall_ms": result["prefill"]["wall_ms_median"],
                      "prefill_gpu_ms": result["prefill"].get("total_gpu_ms")}), flush=True)


if __name__ == "__main__":
    main()
