"""The fp8 (e4m3) cache writes of triton_flash (K and V halves) and triton_mla (latent and rope parts), which
quantize in the kernel (interpreted on the CPU, compiled on a GPU): the written bytes equal torch's
`quantize_kv` bit for bit, for random inputs over many decades and for the shared e4m3 edge list
(`keel.testing.e4m3_edges`), at scales != 1, from bf16 / fp16 / fp32 inputs that are strided views (as a
fused projection hands them over), at odd shapes; every other byte of a randomly poisoned cache is left as
it was, and tokens with slot -1 write nothing."""

from __future__ import annotations

import pytest
import torch
from keel_attention_flash.impl import TritonFlashAttentionImpl
from keel_attention_flash.mla_impl import TritonMLAImpl

from keel.attention.backend import AttentionLayerConfig
from keel.layers.fp8_utils import FP8
from keel.layers.kv_scales import quantize_kv
from keel.testing.e4m3_edges import assert_same_e4m3_bytes, e4m3_edge_values

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(tokens: int, width: int, scale: float, dtype: torch.dtype, gen: torch.Generator, edges: bool
           ) -> torch.Tensor:  # [tokens, width] float32: the edge list (as x / scale sees it) or random values
    if edges:
        e = e4m3_edge_values()
        x = e[torch.arange(tokens * width) % e.numel()] * scale  # exact: power-of-two scales
    else:  # magnitudes over 8 decades around the scale: subnormals, normals and saturation
        x = torch.randn(tokens * width, generator=gen) * scale * torch.logspace(-5, 3, tokens * width)[
            torch.randperm(tokens * width, generator=gen)]
    return x.view(tokens, width).to(dtype)


def poisoned_cache(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:  # e4m3, random bytes
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(FP8)


def slots_for(tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:  # [tokens] int64, some -1
    slots = torch.randperm(num_slots, generator=gen)[:tokens]
    slots[1::3] = -1  # padding tokens (a captured graph's extra rows)
    return slots


@pytest.mark.parametrize("dtype,kv_heads,head,tokens,k_scale,v_scale,edges", [
    (torch.bfloat16, 3, 40, 7, 0.37, 2.5, False),
    (torch.float16, 1, 24, 5, 0.05, 0.02, False),
    (torch.float32, 2, 64, 9, 1.0, 0.01, False),
    (torch.float32, 3, 40, 11, 0.5, 2.0**-6, True),
])
def test_flash_fp8_write_is_quantize_kv(dtype, kv_heads, head, tokens, k_scale, v_scale, edges):
    gen = torch.Generator().manual_seed(tokens)
    block_size, num_blocks = 4, 6
    layer = AttentionLayerConfig(2 * kv_heads, kv_heads, head, head**-0.5, dtype, block_size, kv_cache_dtype=FP8)
    impl = TritonFlashAttentionImpl(layer)
    scales = torch.tensor([k_scale], device=DEVICE), torch.tensor([v_scale], device=DEVICE)
    impl.set_kv_scales(*scales)
    width = kv_heads * head
    k = inputs(tokens, width, k_scale, dtype, gen, edges)
    v = inputs(tokens, width, v_scale, dtype, gen, edges).flip(0)  # other edge values in the V rows
    q = torch.randn(tokens, 2 * width, generator=gen).to(dtype)
    qkv = torch.cat((q, k, v), 1).to(DEVICE)  # k, v: strided views, as a fused QKV projection gives them
    k_view = qkv[:, 2 * width : 3 * width].view(tokens, kv_heads, head)
    v_view = qkv[:, 3 * width :].view(tokens, kv_heads, head)
    want = poisoned_cache((2, num_blocks, block_size, kv_heads, head), gen)
    cache = want.to(DEVICE, copy=True)
    slots = slots_for(tokens, num_blocks * block_size, gen)
    impl.write_kv(k_view, v_view, cache, slots.to(DEVICE))
    keep = slots >= 0
    flat = want.view(2, -1, kv_heads, head)
    flat[0, slots[keep]] = quantize_kv(k.view(tokens, kv_heads, head)[keep], scales[0].cpu(), FP8)
    flat[1, slots[keep]] = quantize_kv(v.view(tokens, kv_heads, head)[keep], scales[1].cpu(), FP8)
    assert_same_e4m3_bytes(cache, want)


def mla_layer(lora: int, rope: int, dtype: torch.dtype) -> AttentionLayerConfig:
    return AttentionLayerConfig(
        num_heads=4, num_kv_heads=1, head_size=lora + rope, scale=0.1, dtype=dtype, block_size=4, use_mla=True,
        kv_cache_dtype=FP8,
        extra=(("kv_lora_rank", lora), ("qk_nope_head_dim", 16), ("qk_rope_head_dim", rope), ("v_head_dim", 16)))


@pytest.mark.parametrize("dtype,lora,rope,tokens,scale,edges", [
    (torch.bfloat16, 40, 8, 7, 0.37, False),
    (torch.float32, 32, 12, 5, 0.02, False),
    (torch.float32, 48, 16, 17, 0.25, True),
])
def test_mla_fp8_latent_write_is_quantize_kv(dtype, lora, rope, tokens, scale, edges):
    gen = torch.Generator().manual_seed(tokens + lora)
    num_blocks = 5
    impl = TritonMLAImpl(mla_layer(lora, rope, dtype))
    k_scale = torch.tensor([scale], device=DEVICE)
    impl.set_kv_scales(k_scale, torch.tensor([123.0], device=DEVICE))  # the latent uses k_scale only
    latent = inputs(tokens, lora + rope, scale, dtype, gen, edges)
    # the kv projection's output: [kv_c | k_pe | the q_a part it shares a GEMM with], strided parts
    proj = torch.cat((latent, torch.randn(tokens, 5, generator=gen).to(dtype)), 1).to(DEVICE)
    want = poisoned_cache((num_blocks, 4, lora + rope), gen)
    cache = want.to(DEVICE, copy=True)
    slots = slots_for(tokens, num_blocks * 4, gen)
    impl.write_latent(proj[:, :lora], proj[:, lora : lora + rope], cache, slots.to(DEVICE))
    keep = slots >= 0
    want.view(-1, lora + rope)[slots[keep]] = quantize_kv(latent[keep], k_scale.cpu(), FP8)
    assert_same_e4m3_bytes(cache, want)
