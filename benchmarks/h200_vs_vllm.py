"""keel and vLLM side by side on one GPU: the same checkpoint, prompts and engine limits, each engine in
its own process (the vllm-peer harness's protocol, plus what the comparison needs to be trusted).

    python benchmarks/h200_vs_vllm.py --arch llama8b|dsv2lite [--engines keel,vllm] [--vllm-site DIR]
        [--model-dir DIR | --write-checkpoint DIR [--quantization gptq] | --quantization fp8-tensor|fp8-block|gptq]
        [--num-prompts 1000]
        [--out FILE.json] [--diagnose]

Per engine: start time; a 16 x 16-token warm call (the same for both engines); then two rounds of
`num_prompts` distinct random prompts (128 in / 128 out, greedy, ignore_eos), other prompts each round, so
neither round can hit the prefix cache: round 1 is the first big batch after start, round 2 a warm engine;
batch-1 decode ms per output token ((t(257 tokens) - t(1 token)) / 256, best of 3). Then the first 8 greedy
tokens of 4 round-2 prompts (`first_tokens`, from the big batch) and the same prompts alone with their top-2
logprobs (`top2`); with both engines in one run, `greedy_divergence` names the first position each prompt's
tokens part and both engines' top-1 minus top-2 gap there (`divergence()`: for runs in separate calls too).
Engine `hf` is the reference for those rows: transformers on the checkpoint's weights, dequantized, the same 4
prompts alone (`reference_rows`; `vs_reference` reads each engine's rows against it, `reference_gap()`).

Same weights: with `load_format="dummy"` each engine draws its own random weights, and for an MoE model the
router then decides how many experts a step reads. `--write-checkpoint DIR` writes one seeded random
checkpoint in the hub layout (per-expert tensors, as DeepSeek's released checkpoints store them) that both
engines then load (`--model-dir DIR`). Without a checkpoint both use dummy weights (fine for dense models).

`--diagnose` (keel only) records, per round, what ran lazily: Triton compiles (kernel, seconds), CUDA
graph captures, device allocations (cudaMalloc count and bytes reserved), and the slowest engine steps with
the token counts they scheduled -- the cold-start penalty's causes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
DSV2_LITE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                 num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
                 n_routed_experts=64, num_experts_per_tok=6, routed_scaling_factor=1.0, kv_lora_rank=512,
                 q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                 topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False, first_k_dense_replace=1,
                 moe_layer_freq=1, max_position_embeddings=163840, rope_theta=10000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                 rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})
LIMITS = dict(max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.85)
PROMPT_LEN, OUTPUT_LEN = 128, 128


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(100, vocab - 100) for _ in range(PROMPT_LEN)] for _ in range(n)]


# ------------------------------------------------------------------ checkpoint (same weights for both)

def hub_tensors_dsv2(c: dict):
    """(name, shape) of every tensor of a DeepSeek-V2 checkpoint in the hub layout (q_lora_rank None)."""
    h, nh = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    yield "model.embed_tokens.weight", (c["vocab_size"], h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (nh * qk, h)
        yield p + "self_attn.kv_a_proj_with_mqa.weight", (c["kv_lora_rank"] + c["qk_rope_head_dim"], h)
        yield p + "self_attn.kv_a_layernorm.weight", (c["kv_lora_rank"],)
        yield p + "self_attn.kv_b_proj.weight", (nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
        yield p + "self_attn.o_proj.weight", (h, nh * c["v_head_dim"])
        if i < c["first_k_dense_replace"]:
            mlps = [("mlp.", c["intermediate_size"])]
        else:
            yield p + "mlp.gate.weight", (c["n_routed_experts"], h)
            mlps = [(f"mlp.experts.{e}.", c["moe_intermediate_size"]) for e in range(c["n_routed_experts"])]
            mlps.append(("mlp.shared_experts.", c["moe_intermediate_size"] * c["n_shared_experts"]))
        for m, inter in mlps:
            yield p + m + "gate_proj.weight", (inter, h)
            yield p + m + "up_proj.weight", (inter, h)
            yield p + m + "down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (c["vocab_size"], h)


def hub_tensors_llama(c: dict):
    """(name, shape) of every tensor of a Llama checkpoint in the hub layout."""
    h, nh, nkv, inter = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    hd = h // nh
    yield "model.embed_tokens.weight", (c["vocab_size"], h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        for name, n in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd), ("o_proj", h)):
            yield p + f"self_attn.{name}.weight", (n, h)
        yield p + "mlp.gate_proj.weight", (inter, h)
        yield p + "mlp.up_proj.weight", (inter, h)
        yield p + "mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (c["vocab_size"], h)


GPTQ_ZEROS = 0x77777777  # eight nibbles of 7: zero point 8 stored minus one (checkpoint_format gptq)


def gptq_tensors(name: str, shape: tuple[int, int], gen, act_order: bool = False, g_idx=None) -> dict:
    """A linear weight [N, K] in GPTQ's 4-bit g128 layout (sym; `act_order`: desc_act's g_idx, each group 128
    inputs drawn at random, as GPTQ's activation order leaves them, or `g_idx` if given) with random codes:
    qweight [K/8, N] int32 (8 inputs a word), qzeros [K/128, N/8], scales [K/128, N] fp16 sized so the weight's
    std is ~1/sqrt(K) (codes 0..15 about 8: std 4.6 scales), g_idx [K]. Values, not a quantized model: enough
    for both engines to run the same GPTQ kernels on the same bytes."""
    import torch

    n, k = shape
    g = QUANTIZATION["gptq"]["group_size"]
    base = name.removesuffix(".weight")
    qweight = torch.randint(-(1 << 31), (1 << 31) - 1, (k // 8, n), generator=gen, device=gen.device, dtype=torch.int32)
    scales = (torch.rand(k // g, n, generator=gen, device=gen.device) * 0.5 + 0.75) / (4.6 * k**0.5)
    return {base + ".qweight": qweight.cpu(),
            base + ".qzeros": torch.full((k // g, n // 8), GPTQ_ZEROS, dtype=torch.int32),
            base + ".scales": scales.half().cpu(),
            base + ".g_idx": (g_idx.clone() if g_idx is not None else  # safetensors stores no shared tensors
                              torch.randperm(k, generator=gen, device=gen.device).cpu().to(torch.int32) // g
                              if act_order else torch.arange(k, dtype=torch.int32) // g)}


def shared_input(name: str) -> str:
    """Projections reading the same activations: q / k / v, gate / up. GPTQ's activation order sorts a layer's
    inputs by its Hessian, which only the input decides, so a real desc_act checkpoint gives them one g_idx."""
    return re.sub(r"\.(q|k|v)_proj\.", ".qkv_proj.", re.sub(r"\.(gate|up)_proj\.", ".gate_up_proj.", name))


def checkpoint_tensors(name: str, shape: tuple[int, ...], gen, quantization: str | None, g_idx_of: dict,
                       ignored: tuple[str, ...] = ()) -> dict:
    """One hub tensor of `write_checkpoint` (drawn on `gen`'s device, returned on the CPU): norms 1, matrices
    N(0, 1/fan_in) in bf16, or with quantization "gptq" / "gptq-act" the projections in GPTQ's layout, with
    "fp8-block" in DeepSeek-V3's block-fp8 layout (e4m3 `weight` + float32 `weight_scale_inv` per 128 x 128 block,
    keel's quantizer; the router, embeddings, lm_head and the `ignored` modules stay bf16); `g_idx_of` carries
    the g_idx drawn for each `shared_input` so projections reading the same activations share it."""
    import torch

    if len(shape) == 1:
        return {name: torch.ones(shape, dtype=torch.bfloat16)}
    if (quantization == "fp8-block" and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))
            and not any(name.startswith(m + ".") for m in ignored)):
        from keel_quantization.fp8_math import quantize_blocks

        w = torch.randn(shape, generator=gen, device=gen.device, dtype=torch.float32) / shape[1] ** 0.5
        q, s = quantize_blocks(w, tuple(QUANTIZATION["fp8-block"]["weight_block_size"]))
        return {name: q.cpu(), name.removesuffix("weight") + "weight_scale_inv": s.cpu()}
    if quantization in ("gptq", "gptq-act") and name.endswith("_proj.weight"):
        ts = gptq_tensors(name, shape, gen, act_order=quantization == "gptq-act",
                          g_idx=g_idx_of.get(shared_input(name)))
        g_idx_of[shared_input(name)] = next(t for key, t in ts.items() if key.endswith(".g_idx"))
        return ts
    t = torch.randn(shape, generator=gen, device=gen.device, dtype=torch.float32) / shape[1] ** 0.5
    return {name: t.to(torch.bfloat16).cpu()}


def write_checkpoint(out: Path, arch: str, seed: int = 0, shard_bytes: int = 4 << 30,
                     quantization: str | None = None, device: str = "cuda") -> None:
    """Seeded random weights (norms 1, matrices N(0, 1/fan_in), like keel's dummy init), bf16 shards; with
    quantization "gptq" / "gptq-act" (Llama-8B only) the projections in GPTQ's layout (`gptq_tensors`; -act:
    desc_act's shuffled groups), "fp8-block" (DSV2-Lite only: its routing then is the same in both engines) in
    DeepSeek-V3's block-fp8 layout. `device`: where the draws are made (the CPU's generator draws other
    numbers than the GPU's for the same seed)."""
    import torch
    from safetensors.torch import save_file

    if (arch, quantization) not in (("dsv2lite", None), ("dsv2lite", "fp8-block"), ("llama8b", "gptq"),
                                    ("llama8b", "gptq-act")):
        raise SystemExit("--write-checkpoint: dsv2lite in bf16 or fp8-block, llama8b in gptq / gptq-act (dense "
                         "models compare fine on dummy weights)")
    write_config(out, arch, quantization)
    ignored = tuple(quantization_config(arch, quantization).get("ignored_layers", ())) if quantization else ()
    gen = torch.Generator(device=device).manual_seed(seed)
    shard, size, index, n = {}, 0, {}, 0
    g_idx_of: dict = {}  # shared_input(name) -> the g_idx its first projection drew

    def flush():
        nonlocal shard, size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard, size, n = {}, 0, n + 1

    tensors = hub_tensors_dsv2(DSV2_LITE) if arch == "dsv2lite" else hub_tensors_llama(LLAMA3_8B)
    for name, shape in tensors:
        ts = checkpoint_tensors(name, shape, gen, quantization, g_idx_of, ignored)
        shard.update(ts)
        size += sum(t.numel() * t.element_size() for t in ts.values())
        if size >= shard_bytes:
            flush()
    flush()
    del gen
    if device == "cuda":
        torch.cuda.empty_cache()  # the engines' processes measure free device memory at start
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))


# --quantization: a quantization_config both engines read from config.json (dummy weights are then drawn
# in that layout); vLLM's "fp8" checkpoint format, per-tensor or DeepSeek's 128x128 blocks; GPTQ 4-bit
# group 128 (vLLM serves it with its Marlin kernels, as it does a hub GPTQ checkpoint).
QUANTIZATION = {"fp8-tensor": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"},
                "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": [128, 128]},
                "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
                         "checkpoint_format": "gptq", "lm_head": False},
                "gptq-act": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": True,
                             "checkpoint_format": "gptq", "lm_head": False}}


LOG_CHOICES = re.compile(r"marlin|quantiz|kernel|backend|fp8|gptq", re.IGNORECASE)


def write_config(out: Path, arch: str, quantization: str | None = None) -> None:
    from transformers import DeepseekV2Config, LlamaConfig

    out.mkdir(parents=True, exist_ok=True)
    if arch == "llama8b":
        cfg = LlamaConfig(**LLAMA3_8B)
        cfg.architectures = ["LlamaForCausalLM"]
    else:
        cfg = DeepseekV2Config(**DSV2_LITE)
        cfg.architectures = ["DeepseekV2ForCausalLM"]
    cfg.torch_dtype = "bfloat16"
    cfg.save_pretrained(out)
    if quantization is not None:
        raw = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**raw, "quantization_config": quantization_config(arch,
                                                                                                       quantization)}))


def quantization_config(arch: str, quantization: str) -> dict:
    """QUANTIZATION[quantization] for `arch`: DSV2-Lite's dense first layers' MLP (intermediate 10944, not a
    multiple of the 128-row block) stays bf16 in block fp8, as a checkpoint of this shape would have to leave it
    (vLLM refuses the split; `h200_quant.py`'s case does the same). The modules are named one by one: vLLM
    matches `ignored_layers` by exact module name, so "model.layers.0.mlp" alone left its down_proj quantized
    there (and its activation quantization asserted on the 10944-wide input)."""
    cfg = dict(QUANTIZATION[quantization])
    if arch == "dsv2lite" and "weight_block_size" in cfg and DSV2_LITE["intermediate_size"] % 128:
        cfg["ignored_layers"] = [f"model.layers.{i}.mlp.{p}" for i in range(DSV2_LITE["first_k_dense_replace"])
                                 for p in ("gate_proj", "up_proj", "down_proj")]
    return cfg


# ------------------------------------------------------------------ keel diagnosis hooks

class LazyWork:
    """What a round did lazily: Triton compiles, CUDA graph captures, device allocations, slow steps."""

    def __init__(self, llm) -> None:
        import torch
        import triton

        self.torch = torch
        self.compiles: list[tuple[str, float]] = []
        self.variants: list[list[str]] = []
        self._t0 = {}
        knobs = triton.knobs.runtime

        def before(*args, **kw):
            self._t0[kw.get("key", id(kw))] = time.perf_counter()
            return False  # never skip the compile

        def after(*args, **kw):
            fn = kw.get("fn")
            name = getattr(fn, "name", None) or str(kw.get("repr", "?"))[:60]
            t0 = self._t0.pop(kw.get("key", id(kw)), None)
            self.compiles.append((name, time.perf_counter() - t0 if t0 else -1.0))
            if len(self.variants) < 40:  # what made this a new variant: specialization attrs, constants
                comp = kw.get("compile") or {}
                self.variants.append([name, str({k: v for k, v in comp.items() if k in
                                                 ("signature", "constants", "attrs", "configs")})[:2500],
                                      str(kw.get("repr"))[:1500]])

        knobs.jit_cache_hook = before
        knobs.jit_post_compile_hook = after
        self.captures = 0
        original_capture = torch.cuda.CUDAGraph.capture_begin

        def capture_begin(graph, *a, **k):
            self.captures += 1
            return original_capture(graph, *a, **k)

        torch.cuda.CUDAGraph.capture_begin = capture_begin
        engine = llm.llm_engine
        self.steps: list[tuple[float, int, int]] = []
        worker = engine.core.worker
        launch = worker.execute_model_async
        self._last = (0, 0)

        def execute_model_async(so):
            self._last = (so.total_num_scheduled_tokens, len(so.num_scheduled_tokens))
            return launch(so)

        worker.execute_model_async = execute_model_async
        step = engine.step

        def timed_step():
            t = time.perf_counter()
            out = step()
            self.steps.append((time.perf_counter() - t, *self._last))
            return out

        engine.step = timed_step

    def start(self) -> None:
        self.compiles.clear()
        self.variants.clear()
        self.steps.clear()
        self.captures = 0
        self.mem0 = self.torch.cuda.memory_stats()

    def report(self) -> dict:
        mem = self.torch.cuda.memory_stats()
        by_kernel: dict[str, list] = {}
        for name, s in self.compiles:
            e = by_kernel.setdefault(name, [0, 0.0])
            e[0] += 1
            e[1] += s
        steps = sorted(self.steps, reverse=True)
        return {
            "triton_compiles": len(self.compiles),
            "triton_compile_s": round(sum(s for _, s in self.compiles), 3),
            "compiles_by_kernel": {k: [n, round(s, 3)] for k, (n, s) in
                                   sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:20]},
            "variants": list(self.variants),
            "graph_captures": self.captures,
            "cuda_mallocs": mem.get("num_device_alloc", 0) - self.mem0.get("num_device_alloc", 0),
            "alloc_retries": mem.get("num_alloc_retries", 0) - self.mem0.get("num_alloc_retries", 0),
            "reserved_gib": round(mem.get("reserved_bytes.all.current", 0) / 2**30, 2),
            "steps": len(self.steps),
            "step_s_total": round(sum(s for s, _, _ in self.steps), 3),
            "slowest_steps": [[round(s * 1000, 1), tok, reqs] for s, tok, reqs in steps[:12]],
            # steps that prefill (more tokens than requests) and decode-only steps: (count, total s), so that the
            # round's wall can be set against the step profile's GPU time of each kind
            "prefill_steps": [sum(1 for _, tok, reqs in steps if tok > reqs),
                              round(sum(s for s, tok, reqs in steps if tok > reqs), 3)],
            "decode_steps": [sum(1 for _, tok, reqs in steps if tok <= reqs),
                             round(sum(s for s, tok, reqs in steps if tok <= reqs), 3)],
            "median_step_ms": round(steps[len(steps) // 2][0] * 1000, 2) if steps else None,
        }


# ------------------------------------------------------------------ one engine

def top2(completion) -> list[list]:
    """[token, its logprob, the runner-up token, its logprob] per generated position of a greedy completion
    asked for 2 logprobs (keel's and vLLM's outputs alike: a dict token -> Logprob per position)."""
    rows = []
    for tok, d in zip(completion.token_ids, completion.logprobs or []):
        best = sorted(d.items(), key=lambda kv: -kv[1].logprob)[:2] + [(None, None)]
        rows.append([tok, round(best[0][1].logprob, 5), best[1][0],
                     None if best[1][1] is None else round(best[1][1].logprob, 5)])
    return rows


def _first_difference(ra: list, rb: list) -> int | None:
    """The first position two `top2` rows' greedy tokens part (None: equal throughout)."""
    return next((j for j, (x, y) in enumerate(zip(ra, rb)) if x[0] != y[0]), None)


def _gap(r: list, i: int | None) -> float | None:
    """A `top2` row's top-1 minus top-2 logprob at position i (None where there is no position or runner-up)."""
    return None if i is None or r[i][3] is None else round(r[i][1] - r[i][3], 5)


def divergence(a: dict, b: dict) -> list[dict]:
    """Per prompt of two engines' `top2` rows: the first position their greedy tokens part (None: equal
    throughout) and each engine's top-1 minus top-2 logprob there -- a gap of ~1e-3 or less on either side is a
    near-tie that summation order decides, not a wrong kernel."""
    out = []
    for ra, rb in zip(a.get("top2", []), b.get("top2", [])):
        i = _first_difference(ra, rb)
        out.append({"first_difference": i, "gap_a": _gap(ra, i), "gap_b": _gap(rb, i)})
    return out


def reference_gap(row: dict, ref: dict) -> list[dict]:
    """Per prompt of an engine's `top2` rows against the reference's (engine "hf"): the first position its greedy
    tokens part from the reference's (None: equal throughout), the reference's top-1 minus top-2 logprob there, and
    the largest difference of the chosen token's logprob before it."""
    out = []
    for ra, rb in zip(row.get("top2", []), ref.get("top2", [])):
        i = _first_difference(ra, rb)
        same = ra[:i] if i is not None else ra
        out.append({"first_difference": i, "reference_gap": _gap(rb, i),
                    "max_logprob_diff": round(max((abs(x[1] - y[1]) for x, y in zip(same, rb)), default=0.0), 5)})
    return out


def reference_rows(model_dir: str, ps: list[list[int]], steps: int = 8) -> dict:
    """transformers on `model_dir`'s weights (fp8 ones dequantized: weight x its scale; activations not quantized),
    each prompt alone, greedy `steps` tokens with the top-2 logprobs per position: the reference keel's and vLLM's
    `top2` rows are read against (`reference_gap`). The dequantized copy is written in bf16 (transformers converts
    the hub layout, e.g. its fused experts, only in from_pretrained) and run in float32 where the device holds it."""
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    raw = json.loads(Path(model_dir, "config.json").read_text())
    q = raw.pop("quantization_config", None)
    if q and q.get("quant_method") != "fp8":
        raise SystemExit(f"engine hf: fp8 or unquantized checkpoints only, not {q.get('quant_method')!r}")
    block = tuple(q["weight_block_size"]) if q and q.get("weight_block_size") else None
    scale_suffix = "weight_scale_inv" if block else "weight_scale"
    work = Path(tempfile.mkdtemp(prefix="hf-reference-", dir=os.environ.get("HF_REFERENCE_DIR")))
    try:
        (work / "config.json").write_text(json.dumps(raw))
        weight_map, params = {}, 0
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            out = {}
            with safe_open(str(f), "pt", device=dev) as fh:
                for k in fh.keys():
                    if k.endswith((".weight_scale_inv", ".weight_scale", ".input_scale")):
                        continue
                    t = fh.get_tensor(k)
                    if t.dtype == torch.float8_e4m3fn:  # write_checkpoint keeps a weight's scale in its shard
                        from keel_quantization.fp8_math import dequantize

                        t = dequantize(t, fh.get_tensor(k.removesuffix("weight") + scale_suffix), block, torch.float32)
                    out[k] = t.to(torch.bfloat16).cpu().contiguous()
                    params += t.numel()
            save_file(out, str(work / f.name), metadata={"format": "pt"})
            weight_map.update({k: f.name for k in out})
        (work / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        fits = dev == "cpu" or torch.cuda.mem_get_info()[0] > params * 4 * 1.1 + (4 << 30)
        dtype = torch.float32 if fits else torch.bfloat16
        model = AutoModelForCausalLM.from_pretrained(str(work), dtype=dtype).to(dev).eval()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    with torch.no_grad():
        for p in ps:
            ids, r = torch.tensor([p], device=dev), []
            for _ in range(steps):  # no KV cache: `steps` forwards of a short prompt
                lp = torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1)
                v, i = lp.topk(2)
                r.append([int(i[0]), round(float(v[0]), 5), int(i[1]), round(float(v[1]), 5)])
                ids = torch.cat([ids, i[:1].view(1, 1)], dim=1)
            rows.append(r)
    return {"engine": "hf", "quantization_applied": f"{q['quant_method']}, dequantized" if q else None,
            "dtype": str(dtype).removeprefix("torch."), "top2": rows}


def run_one(engine: str, model_dir: str, num_prompts: int, dummy: bool, diagnose: bool) -> None:
    load_format = "dummy" if dummy else "auto"
    if engine == "hf":  # the reference rows only (no throughput): the same 4 prompts as the engines' `top2`
        vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
        t0 = time.perf_counter()
        row = reference_rows(model_dir, prompts(num_prompts, vocab, seed=1)[:4])
        print(json.dumps({**row, "run_s": round(time.perf_counter() - t0, 1)}), flush=True)
        return
    t0 = time.perf_counter()
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=model_dir, dtype="bfloat16", load_format=load_format, skip_tokenizer_init=True, seed=0,
                  **LIMITS)
        wrap = lambda ids: TokensPrompt(prompt_token_ids=ids)
        sp = lambda n, lp=None: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False,
                                               logprobs=lp)
    else:
        from keel import LLM, SamplingParams

        if os.environ.get("INT4_DEQUANT_MIN_M"):  # a benchmark's what-if: where int4 steps dequantize + cuBLAS
            from keel_quantization import int4_linear

            int4_linear.DEQUANT_GEMM_MIN_M = int(os.environ["INT4_DEQUANT_MIN_M"])
        llm = LLM(model=model_dir, profile=os.environ.get("KEEL_PROFILE", "cuda"), dtype="bfloat16",
                  load_format=load_format, skip_tokenizer_init=True, seed=0, **LIMITS)
        wrap = lambda ids: {"prompt_token_ids": ids}
        sp = lambda n, lp=None: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=lp)
    init_s = time.perf_counter() - t0
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    lazy = LazyWork(llm) if diagnose and engine == "keel" else None
    llm.generate([wrap(p) for p in prompts(16, vocab, seed=99)], sp(16), use_tqdm=False)
    rounds, diag = [], []
    for r in range(2):  # other prompts each round: round 1 is the first big batch after start
        ps = prompts(num_prompts, vocab, seed=r)
        if lazy:
            lazy.start()
        t = time.perf_counter()
        outs = llm.generate([wrap(p) for p in ps], sp(OUTPUT_LEN), use_tqdm=False)
        dt = time.perf_counter() - t
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        assert gen == num_prompts * OUTPUT_LEN, gen
        rounds.append(round(gen / dt, 1))
        if lazy:
            diag.append(lazy.report())
    one = prompts(1, vocab, seed=7)[0]

    def timed(n: int) -> float:
        t = time.perf_counter()
        o = llm.generate([wrap(one)], sp(n), use_tqdm=False)
        d = time.perf_counter() - t
        assert len(o[0].outputs[0].token_ids) == n
        return d

    timed(8)
    short = min(timed(1) for _ in range(3))
    long_ = min(timed(257) for _ in range(3))
    first = [list(o.outputs[0].token_ids[:8]) for o in outs[:4]]
    # the same 4 prompts alone with their top-2 logprobs: where two engines' greedy tokens part, the gap between
    # the two best there says whether it is a near-tie (summation order) or a real difference (divergence())
    lp_outs = llm.generate([wrap(p) for p in prompts(num_prompts, vocab, seed=1)[:4]], sp(8, 2), use_tqdm=False)
    row = {"engine": engine, "init_s": round(init_s, 1), "num_prompts": num_prompts,
           "load_format": load_format, "quantization_applied": applied_quantization(llm, engine),
           "throughput_out_tok_s": rounds,
           "round1_vs_round2": round(rounds[0] / rounds[1], 3),
           "b1_ms_per_token": round((long_ - short) / 256 * 1000, 3), "first_tokens": first,
           "top2": [top2(o.outputs[0]) for o in lp_outs]}
    if diag:
        row["lazy_work_per_round"] = diag
    print(json.dumps(row), flush=True)


def applied_quantization(llm, engine: str) -> str | None:
    """The quantization method the engine says it runs (None: unquantized). keel refuses a checkpoint's
    quantization_config it cannot serve, so it runs what config.json names; vLLM reports its choice (e.g.
    gptq_marlin) in its model config -- a 2026-12-06 GPTQ run gave its bf16 run's tokens and speed."""
    try:
        if engine == "vllm":
            eng = llm.llm_engine
            mc = getattr(eng, "model_config", None) or eng.vllm_config.model_config
            return mc.quantization
        return llm.llm_engine.config.model.quantization or _checkpoint_quant_method(llm)
    except Exception as e:  # a benchmark records what it could not read rather than failing the run
        return f"unknown ({type(e).__name__}: {e})"


def _checkpoint_quant_method(llm) -> str | None:
    path = Path(llm.llm_engine.config.model.model, "config.json")
    return json.loads(path.read_text()).get("quantization_config", {}).get("quant_method") if path.exists() else None


def versions(engine: str) -> dict:
    import torch
    import triton

    v = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name()}
    try:
        import transformers
        v["transformers"] = transformers.__version__
    except ImportError:
        pass
    if engine == "vllm":
        import vllm
        v["vllm"] = vllm.__version__
    return v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=["llama8b", "dsv2lite"], default="llama8b")
    ap.add_argument("--engines", default="keel,vllm", help="keel, vllm, hf (transformers on the checkpoint's "
                    "weights, dequantized: the reference top-2 rows only; needs --model-dir)")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, default=LIMITS["max_num_seqs"],
                    help="both engines' max_num_seqs (default: issue 11's 256; larger batches for issue 12's fp8 "
                         "throughput, recorded in the result's limits)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                    help="both engines' KV cache dtype (fp8: e4m3, unit scales; recorded in the result's limits)")
    ap.add_argument("--model-dir", default=None, help="a checkpoint with weights both engines load")
    ap.add_argument("--write-checkpoint", default=None, help="write a seeded random checkpoint here first")
    ap.add_argument("--vllm-site", default=None, help="PYTHONPATH for the vLLM process only")
    ap.add_argument("--diagnose", action="store_true")
    ap.add_argument("--quantization", choices=sorted(QUANTIZATION), default=None,
                    help="dummy weights in this quantized layout, for both engines (no checkpoint)")
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dummy", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    LIMITS["max_num_seqs"] = a.max_num_seqs
    if a.kv_cache_dtype != "auto":  # only when asked, so earlier result files' limits read the same
        LIMITS["kv_cache_dtype"] = a.kv_cache_dtype
    if a.one:
        run_one(a.one, a.model_dir, a.num_prompts, a.dummy, a.diagnose)
        return
    dummy = a.model_dir is None and a.write_checkpoint is None
    if dummy and "hf" in a.engines.split(","):
        ap.error("engine hf reads a checkpoint's weights: name --model-dir or --write-checkpoint")
    if a.write_checkpoint:
        t = time.perf_counter()
        write_checkpoint(Path(a.write_checkpoint), a.arch, quantization=a.quantization)
        print(json.dumps({"checkpoint_written_s": round(time.perf_counter() - t, 1)}), flush=True)
    model_dir = a.model_dir or a.write_checkpoint
    if model_dir is None:
        model_dir = tempfile.mkdtemp()
        write_config(Path(model_dir), a.arch, a.quantization)
    elif a.quantization and not a.write_checkpoint:
        ap.error("--quantization describes dummy weights (or, with --write-checkpoint, the checkpoint written); "
                 "a checkpoint carries its own quantization_config")
    # what the engines must apply: the dummy layout asked for, or the checkpoint's own quantization_config
    asked = a.quantization or json.loads(Path(model_dir, "config.json").read_text()).get(
        "quantization_config", {}).get("quant_method")
    result = {"arch": a.arch, "quantization": asked, "limits": LIMITS, "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN,
              "same_weights": not dummy, "commit": os.environ.get("KEEL_COMMIT", "?"), "engines": {}}
    for engine in a.engines.split(","):
        env = dict(os.environ)
        if engine == "vllm":
            env.update(VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
            if a.vllm_site:
                env["PYTHONPATH"] = a.vllm_site
        cmd = [sys.executable, __file__, "--one", engine, "--model-dir", model_dir,
               "--num-prompts", str(a.num_prompts), "--max-num-seqs", str(a.max_num_seqs),
               "--kv-cache-dtype", a.kv_cache_dtype] + \
              (["--dummy"] if dummy else []) + \
              (["--diagnose"] if a.diagnose else [])
        t = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(lines[-1]) if (lines and not p.returncode) else \
                {"engine": engine, "error": p.returncode, "stderr_tail": p.stderr[-3000:]}
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else str(e.stderr)
            row = {"engine": engine, "error": "timeout", "stderr_tail": err[-3000:]}
        row["process_s"] = round(time.perf_counter() - t, 1)
        if "error" not in row:  # which kernels the engine chose (vLLM logs its quantization / attention choices;
            # its engine core process may log to stdout)
            row["log_choices"] = [ln[-300:] for ln in (p.stderr + p.stdout).splitlines()
                                  if LOG_CHOICES.search(ln) and not ln.startswith("{")][-20:]
            if asked and not row.get("quantization_applied"):
                row["error"] = (f"asked for {asked} (config.json's quantization_config), the engine "
                                f"reports {row.get('quantization_applied')!r}: its figures are not {asked}'s")
        if "error" not in row:
            vcmd = [sys.executable, "-c", f"import json,sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                    f"import h200_vs_vllm as m; print(json.dumps(m.versions({engine!r})))"]
            v = subprocess.run(vcmd, capture_output=True, text=True, env=env, timeout=120)
            row["versions"] = json.loads(v.stdout.strip().splitlines()[-1]) if v.returncode == 0 else v.stderr[-500:]
        print(json.dumps(row), flush=True)
        result["engines"][engine] = row
    eng = result["engines"]
    if "top2" in eng.get("keel", {}) and "top2" in eng.get("vllm", {}):  # a = keel, b = vLLM
        result["greedy_divergence"] = divergence(eng["keel"], eng["vllm"])
    if "top2" in eng.get("hf", {}):
        result["vs_reference"] = {e: reference_gap(r, eng["hf"]) for e, r in eng.items() if e != "hf" and "top2" in r}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
