"""MTP speculative decoding under async scheduling against plain decoding, on one GPU.

    python benchmarks/h200_spec.py [--out benchmarks/results/h200-spec.json] [--layers 27]
    python benchmarks/h200_spec.py --smoke [--out FILE]   # a tiny model, any device, seconds (a test runs it)

The model: DeepSeek-V2-Lite's dimensions as a DeepSeek-V3-style config with one MTP module (V2 has none),
random weights drawn on the device (load_format="dummy": the same seed, so every engine holds the same
target), bf16, then shaped in place so that the draft *agrees* with the target: every block's output
projections (attention o_proj, dense / shared / routed down projections) are damped, so the residual stream
stays near the token embedding and the target is close to a bigram model; the MTP block copies the
target's last layer, its eh_proj passes the token embedding, shared_head is the target's final norm and
lm_head, its embedding the target's. The acceptance that gives is measured, not assumed.

Engines (the `cuda` profile: CUDA graphs, Triton kernels; `--engines`, default plain,mtp_k1,mtp_k3,
mtp_k3_sync): plain decoding, MTP k=1 and k=3 under async scheduling, MTP k=3 without it (what the
overlap is worth); ngram_k3 / ngram_k3_sync measure the n-gram proposer, which must see each step's
tokens on the host (under async scheduling it runs one step at a time). Per engine, batch 1 and batch 32 of distinct random prompts (128 in, 128 out, greedy, ignore_eos;
one warm-up round, then measured rounds of new prompts): ms per output token after the first, what each
round ran lazily on the GPU (Triton compiles, graph captures: round 0 is the cold penalty), tokens per
request step (1 + accepted drafts per verify step), the acceptance rate, and whether the greedy tokens
equal plain decoding's (bf16 verify and decode steps run different kernels, so they may not everywhere).
Results: a JSON file with device, versions and commit.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

_here = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("h200_dsv2lite", _here / "h200_dsv2lite.py")
_dsv2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_dsv2)
sys.path.insert(0, str(_here))  # h200_vs_vllm's LazyWork

SMOKE = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0, "kv_lora_rank": 32,
    "q_lora_rank": None, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16,
    "first_k_dense_replace": 1, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
# Scale of every block's output projections, so the target stays close to a bigram model: the residual
# stream of a 27-layer 2048-wide model moves ~sqrt(54) x 2048**0.5 x damp from its embedding (norm ~45);
# at 0.005 that is ~4%, small against the top-1 / top-2 logit gap of most tokens. The tiny model: 0.05.
DAMP = {"full": 0.005, "smoke": 0.05}


def write_config(shape: dict, layers: int) -> Path:
    """A V3-style config.json (one MTP module, no weights: the engines draw them on the device)."""
    from transformers import DeepseekV3Config

    v3 = {k: v for k, v in shape.items() if k not in ("topk_method", "moe_layer_freq")}
    v3.update(num_hidden_layers=layers, num_nextn_predict_layers=1, n_group=1, topk_group=1, norm_topk_prob=True)
    cfg = DeepseekV3Config(**v3)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    path = Path(tempfile.mkdtemp()) / "dsv3-mtp"
    cfg.save_pretrained(path)
    return path


@torch.no_grad()
def shape_weights(runner, damp: float) -> None:
    """Damp the target's block outputs; make the MTP module (if any) agree with the target (see above)."""
    model = runner.model
    for name, p in model.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight", "w2_weight")):
            p.mul_(damp)
    proposer = runner.proposer
    if getattr(proposer, "layer", None) is None:  # no MTP module (plain decoding, n-gram)
        return
    mtp = proposer.layer
    last = dict(model.model.layers[-1].named_parameters())
    for name, p in mtp.named_parameters():
        if name in last:
            p.copy_(last[name])
    hidden = mtp.eh_proj.weight.shape[0]
    eye = torch.eye(hidden, dtype=mtp.eh_proj.weight.dtype, device=mtp.eh_proj.weight.device)
    mtp.eh_proj.weight.copy_(torch.cat([eye, torch.zeros_like(eye)], dim=1))
    mtp.enorm.weight.fill_(1.0)
    mtp.hnorm.weight.fill_(1.0)
    mtp.shared_head.norm.weight.copy_(model.model.norm.weight)
    mtp.shared_head.head.weight.copy_(model.lm_head.weight)
    mtp.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
    mtp.self_attn.process_weights_after_loading()  # the absorbed W_UK / W_UV of the copied kv_b_proj


def run_round(engine, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    """One batch of prompts at once; per-request decode time after its first token."""
    from keel import SamplingParams
    from keel.engine.output_processor import RequestOutputKind

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    before = engine.get_metrics()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params, RequestOutputKind.DELTA)
    first, tokens, steps = None, {}, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        for o in outs:
            if o.outputs[0].token_ids and first is None:
                first = time.perf_counter()
            tokens.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    end = time.perf_counter()
    after = engine.get_metrics()
    delta = {k: after[k] - before[k] for k in ("spec_decode_num_draft_tokens_total",
                                                "spec_decode_num_accepted_tokens_total", "spec_decode_num_drafts_total")}
    verify_steps = delta["spec_decode_num_drafts_total"]
    return {
        "ms_per_output_token": 1e3 * (end - first) / max(output_len - 1, 1),
        "engine_steps": steps,
        "tokens_per_request_step": 1 + delta["spec_decode_num_accepted_tokens_total"] / verify_steps if verify_steps else 1.0,
        "acceptance_rate": (delta["spec_decode_num_accepted_tokens_total"] / delta["spec_decode_num_draft_tokens_total"]
                            if delta["spec_decode_num_draft_tokens_total"] else None),
        "tokens": [tokens[f"{tag}-{i}"] for i in range(len(prompts))],
    }


# Written before the first GPU run, kept beside the outcome in the result file (ms per output token
# relative to plain decoding at the same batch; >1 = faster). Reasoning: batch 1 is weight-bandwidth bound
# (plain ~3.9 ms/token at 3.3x its floor); a verify step of 1 + k tokens reads the same dense weights and
# up to (1 + k) x 6 experts instead of 6, plus k MTP passes (one layer + its lm_head each); with acceptance
# a ~ 0.8, tokens per step are 1.8 (k=1) and ~2.9 (k=3). Batch 32 is closer to compute bound: verify
# steps of 64 / 128 tokens cost more per step, so the gain shrinks. Async vs sync: the spec step's host
# work (~1-2 ms: sampling metadata, drafts, output processing) is hidden behind the device.
PREDICTIONS = {
    "mtp_k1": {"b1": 1.3, "b32": 1.2}, "mtp_k3": {"b1": 1.6, "b32": 1.3}, "mtp_k3_sync": {"b1": 1.2, "b32": 1.15},
    "ngram_k3": {"b1": 1.2, "b32": 1.0}, "ngram_k3_sync": {"b1": 1.2, "b32": 1.0},
}

ENGINES = {  # name -> (speculative_config, async_scheduling)
    "plain": (None, True),
    "mtp_k1": ({"method": "mtp", "num_speculative_tokens": 1}, True),
    "mtp_k3": ({"method": "mtp", "num_speculative_tokens": 3}, True),
    "mtp_k3_sync": ({"method": "mtp", "num_speculative_tokens": 3}, False),
    "ngram_k3": ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}, True),
    "ngram_k3_sync": ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}, False),
}
DEFAULT_ENGINES = "plain,mtp_k1,mtp_k3,mtp_k3_sync"


def measure(model_dir: Path, spec: dict | None, async_scheduling: bool, batches: list[int], input_len: int,
            output_len: int, rounds: int, vocab: int, smoke: bool, damp: float) -> dict:
    from keel.bench import random_prompts
    from keel.config import EngineArgs
    from keel.engine.llm_engine import LLMEngine

    device_args = ({"platform": "cpu", "dtype": "float32"} if smoke and not torch.cuda.is_available()
                   else {"profile": "cuda", "dtype": "bfloat16"})
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, async_scheduling=async_scheduling,
        max_model_len=input_len + output_len + 16, max_num_seqs=max(batches), speculative_config=spec,
        seed=0, **device_args))
    out: dict = {"startup_s": time.perf_counter() - t0}
    try:
        shape_weights(engine.core.worker.runner, damp)
        lazy = None
        if torch.cuda.is_available() and not smoke:  # what each round runs lazily (the cold penalty)
            from h200_vs_vllm import LazyWork
            lazy = LazyWork(SimpleNamespace(llm_engine=engine))
            out["lazy_work"] = {}
        seed = 1000
        for b in batches:
            runs = []
            for r in range(rounds + 1):  # round 0 warms up (new prompts every round: no prefix hits)
                seed += 1
                prompts = random_prompts(b, input_len, vocab, seed=seed)
                if lazy is not None:
                    lazy.start()
                res = run_round(engine, prompts, output_len, f"b{b}r{r}")
                if lazy is not None:
                    report = lazy.report()
                    out["lazy_work"][f"b{b}r{r}"] = {k: report[k] for k in (
                        "triton_compiles", "triton_compile_s", "compiles_by_kernel", "graph_captures",
                        "cuda_mallocs", "slowest_steps", "median_step_ms")}
                if r:
                    runs.append(res)
            best = min(runs, key=lambda x: x["ms_per_output_token"])
            out[f"b{b}"] = {k: v for k, v in best.items() if k != "tokens"}
            out[f"b{b}"]["rounds_ms_per_output_token"] = [x["ms_per_output_token"] for x in runs]
            out[f"b{b}"]["_tokens"] = [x["tokens"] for x in runs]
        spec_runner = engine.core.worker.runner.spec
        if spec_runner is not None:
            out["device_fixed_requests"] = spec_runner.num_device_fixed
            out["host_waits"] = spec_runner.num_host_waits
        graphs = engine.core.worker.runner.cuda_graphs
        drafts = engine.core.worker.runner.draft_graphs
        out["draft_graph_replays"] = drafts.num_replays if drafts is not None else None
        out["graph_replays_by_query_len"] = dict(getattr(graphs, "replays_by_query_len", {}) or {})
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(_here / "results" / "h200-spec.json"))
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--smoke", action="store_true", help="a tiny model, a few tokens (CPU or GPU)")
    ap.add_argument("--engines", default=DEFAULT_ENGINES, help=f"comma-separated, from {sorted(ENGINES)}")
    ap.add_argument("--damp", type=float, default=None, help="block output scale (default: 0.005; smoke 0.05)")
    ns = ap.parse_args(argv)
    if ns.smoke:
        shape, layers, batches, input_len, output_len, rounds = SMOKE, SMOKE["num_hidden_layers"], [1, 4], 8, 12, 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("h200_spec.py needs a GPU (or --smoke)")
        shape, layers, batches, input_len, output_len, rounds = _dsv2.DSV2_LITE, ns.layers, [1, 32], 128, 128, 2
    damp = ns.damp if ns.damp is not None else DAMP["smoke" if ns.smoke else "full"]
    model_dir = write_config(shape, layers)
    result: dict = {
        "benchmark": "h200_spec", "smoke": ns.smoke, "layers": layers, "input_len": input_len,
        "output_len": output_len, "batches": batches, "damp": damp,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__, "python": platform.python_version(),
    }
    from keel.bench import source_commit

    result["commit"] = source_commit(_here)
    names = [n.strip() for n in ns.engines.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if unknown or "plain" not in names:
        raise SystemExit(f"--engines: unknown {unknown} (known: {sorted(ENGINES)}); 'plain' is required")
    for name in names:
        spec, async_scheduling = ENGINES[name]
        result[name] = measure(model_dir, spec, async_scheduling, batches, input_len, output_len, rounds,
                               shape["vocab_size"], ns.smoke, damp)
        result[name]["async_scheduling"] = async_scheduling
        print(name, {k: v for k, v in result[name].items() if not k.startswith("b")},
              {b: {k: v for k, v in result[name][f"b{b}"].items() if k != "_tokens"} for b in batches}, flush=True)
    for name in [n for n in names if n != "plain"]:
        for b in batches:
            row = result[name][f"b{b}"]
            plain = result["plain"][f"b{b}"]
            row["speedup_vs_plain"] = plain["ms_per_output_token"] / row["ms_per_output_token"]
            if not ns.smoke and b in (1, 32):
                row["predicted_speedup_vs_plain"] = PREDICTIONS[name][f"b{b}"]
            # _tokens: per round, per request, the output tokens (the same prompts in both engines). Per
            # request the first position whose token differs from plain decoding's (its length: none); a bf16
            # near-tie flips one token and so all after it. greedy_equal_to_plain: the share of positions
            # before the first difference; requests_equal_to_plain: the share of requests equal throughout.
            reqs = [(x, y) for rx, ry in zip(row["_tokens"], plain["_tokens"]) for x, y in zip(rx, ry)]
            divergence = [next((i for i, (a, c) in enumerate(zip(x, y)) if a != c), min(len(x), len(y)))
                          for x, y in reqs]
            row["greedy_equal_to_plain"] = sum(divergence) / sum(min(len(x), len(y)) for x, y in reqs)
            row["requests_equal_to_plain"] = sum(x == y for x, y in reqs) / len(reqs)
            row["first_divergence"] = divergence
    for name in names:
        for b in batches:
            result[name][f"b{b}"].pop("_tokens", None)
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", out)
    return result


if __name__ == "__main__":
    main()
