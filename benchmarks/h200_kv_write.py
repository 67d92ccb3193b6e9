"""The KV cache write of one attention layer at Llama-3-8B's shape (8 KV heads x 128, bf16 K and V as strided
views of the QKV projection's output) for 1, 256 and 8192 new tokens:

  fp8_torch   the write before 573430b: keel.layers.kv_scales.quantize_kv on K and on V (~4 torch kernels
              each), then reshape_and_cache_kernel copying the e4m3 bytes
  fp8_fused   TritonFlashAttentionImpl.write_kv into an e4m3 cache: one kernel that quantizes
  bf16        the same write into a bf16 cache (the reference: no quantization at all)

and, for triton_mla, DeepSeek's 512 + 64 latent (fp8_torch / fp8_fused / bf16 likewise).

    python benchmarks/h200_kv_write.py --out benchmarks/results/h200-kv-write.json

Times are CUDA-graph replays (20 calls a graph: no host launch cost, as decode steps run), microseconds a
layer's write. `bit_equal`: the fused write's cache bytes equal the torch path's (the compiled rounding is
torch's). Skips (exit 0) without CUDA. ~10 s on an H200.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

TOKENS = (1, 256, 8192)
HEADS, KV_HEADS, HEAD = 32, 8, 128
LORA, ROPE = 512, 64
BLOCK = 16
SCALES = (0.05, 0.02)  # any scale != 1: the division is on the path
DEVICE = "cuda"  # a smoke run may set "cpu" (TRITON_INTERPRET=1) and call the *_paths builders


def flash_paths(tokens: int, gen: torch.Generator) -> tuple[dict, Callable[[], bool]]:
    """name -> fn(i) writing one layer's K and V, and a check that fp8_fused and fp8_torch wrote the same bytes."""
    from keel_attention_flash import kernels
    from keel_attention_flash.impl import TritonFlashAttentionImpl, _pow2

    from keel.attention.backend import AttentionLayerConfig
    from keel.layers.fp8_utils import FP8
    from keel.layers.kv_scales import quantize_kv

    width = (HEADS + 2 * KV_HEADS) * HEAD
    qkv = torch.randn(tokens, width, device=DEVICE, generator=gen, dtype=torch.bfloat16)  # [T, (32 + 16) * 128]
    k = qkv[:, HEADS * HEAD : (HEADS + KV_HEADS) * HEAD].view(tokens, KV_HEADS, HEAD)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD :].view(tokens, KV_HEADS, HEAD)
    num_blocks = -(-tokens // BLOCK) + 1
    slots = torch.randperm(num_blocks * BLOCK, device=DEVICE, generator=gen)[:tokens]  # [T] int64
    shape = (2, num_blocks, BLOCK, KV_HEADS, HEAD)
    caches = {name: torch.zeros(shape, dtype=torch.uint8, device=DEVICE).view(FP8) for name in ("torch", "fused")}
    bf16_cache = torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE)
    scales = [torch.tensor([s], device=DEVICE) for s in SCALES]

    def impl(cache_dtype):
        out = TritonFlashAttentionImpl(AttentionLayerConfig(HEADS, KV_HEADS, HEAD, HEAD**-0.5, torch.bfloat16, BLOCK,
                                                            kv_cache_dtype=cache_dtype))
        if cache_dtype is not None:
            out.set_kv_scales(*scales)
        return out

    fp8, bf16 = impl(FP8), impl(None)

    def old(i):  # the former TritonFlashAttentionImpl.forward: quantized in torch, copied as bytes
        kq, vq = quantize_kv(k, scales[0], FP8), quantize_kv(v, scales[1], FP8)
        kernels.reshape_and_cache_kernel[(tokens,)](
            kq, vq, caches["torch"], slots, kq.stride(0), kq.stride(1), vq.stride(0), vq.stride(1),
            caches["torch"].stride(0), kq, kq, NUM_KV_HEADS=KV_HEADS, HEAD=HEAD, BLOCK_H=_pow2(KV_HEADS),
            BLOCK_D=HEAD, FP8_KV=False)

    paths = {"fp8_torch": old, "fp8_fused": lambda i: fp8.write_kv(k, v, caches["fused"], slots),
             "bf16": lambda i: bf16.write_kv(k, v, bf16_cache, slots)}
    return paths, lambda: torch.equal(caches["torch"].view(torch.uint8), caches["fused"].view(torch.uint8))


def mla_paths(tokens: int, gen: torch.Generator) -> tuple[dict, Callable[[], bool]]:
    from keel_attention_flash import mla_kernels
    from keel_attention_flash.mla_impl import TritonMLAImpl

    from keel.attention.backend import AttentionLayerConfig
    from keel.layers.fp8_utils import FP8
    from keel.layers.kv_scales import quantize_kv

    # kv_a_proj's output [T, L + R] as the layer splits it (strided parts)
    proj = torch.randn(tokens, LORA + ROPE, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    kv_c, k_pe = proj[:, :LORA], proj[:, LORA:]
    num_blocks = -(-tokens // BLOCK) + 1
    slots = torch.randperm(num_blocks * BLOCK, device=DEVICE, generator=gen)[:tokens]
    shape = (num_blocks, BLOCK, LORA + ROPE)
    caches = {name: torch.zeros(shape, dtype=torch.uint8, device=DEVICE).view(FP8) for name in ("torch", "fused")}
    bf16_cache = torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE)
    scale = torch.tensor([SCALES[0]], device=DEVICE)

    def impl(cache_dtype):
        out = TritonMLAImpl(AttentionLayerConfig(
            num_heads=16, num_kv_heads=1, head_size=LORA + ROPE, scale=0.07, dtype=torch.bfloat16, block_size=BLOCK,
            use_mla=True, kv_cache_dtype=cache_dtype,
            extra=(("kv_lora_rank", LORA), ("qk_nope_head_dim", 128), ("qk_rope_head_dim", ROPE), ("v_head_dim", 128))))
        if cache_dtype is not None:
            out.set_kv_scales(scale, scale)
        return out

    fp8, bf16 = impl(FP8), impl(None)

    def old(i):  # the former TritonMLAImpl._write
        c, pe = quantize_kv(kv_c, scale, FP8), quantize_kv(k_pe, scale, FP8)
        mla_kernels.mla_write_latent_kernel[(tokens,)](
            c, pe, caches["torch"], slots, c.stride(0), pe.stride(0), caches["torch"].stride(0),
            caches["torch"].stride(1), c, PAGE=BLOCK, LORA=LORA, BLOCK_L=LORA, ROPE=ROPE, BLOCK_R=ROPE, FP8_KV=False)

    paths = {"fp8_torch": old, "fp8_fused": lambda i: fp8.write_latent(kv_c, k_pe, caches["fused"], slots),
             "bf16": lambda i: bf16.write_latent(kv_c, k_pe, bf16_cache, slots)}
    return paths, lambda: torch.equal(caches["torch"].view(torch.uint8), caches["fused"].view(torch.uint8))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/h200-kv-write.json")
    ns = ap.parse_args()
    if not torch.cuda.is_available():
        print("h200_kv_write: no CUDA device, nothing measured")
        return
    import triton

    from keel.bench import source_commit

    sys.path.insert(0, str(Path(__file__).parent))
    from h200_quant import graph_us

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    start = time.perf_counter()
    rows = []
    for kind, build in (("flash", flash_paths), ("mla", mla_paths)):
        for tokens in TOKENS:
            paths, bit_equal = build(tokens, gen)
            row = {"kind": kind, "tokens": tokens}
            for name, fn in paths.items():
                row[f"{name}_us"] = round(graph_us(fn, 20), 2)
            row["bit_equal"] = bit_equal()
            row["fused_speedup"] = round(row["fp8_torch_us"] / row["fp8_fused_us"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": source_commit(Path(__file__).parent), "kv_scales": SCALES, "rows": rows,
              "wall_s": round(time.perf_counter() - start, 1)}
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
