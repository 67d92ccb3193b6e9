"""Block-FP8 experts in the fused MoE compiled on a GPU (skipped without one): DeepSeek-V2-Lite's shapes (64
experts, hidden 2048, intermediate 1408, top-6, 128 x 128 blocks, bf16 activations) with the tiles the
engine looks up on this device (on an H200 the shipped tables, fitted), at decode and prefill token
counts, every way the activations can enter that the tiles allow, against float32 on the dequantized
experts (W8A8: inputs through e4m3 as the method's reference); and a captured decode step replayed with
fresh routing. (The sm_90 compile of these variants runs without a GPU: test_moe_grouped_gemm_gpu.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from keel_kernels_triton.fused_moe.grouped_gemm import fused_experts_triton
from keel_kernels_triton.fused_moe.tile_config import fp8_block_tiles, get_moe_tile_configs
from triton_test_utils import capture_cuda_graph

from keel.layers.fp8_utils import FP8
from keel.layers.fused_moe import fused_experts_torch
from keel.layers.fused_moe.quant_config import FusedMoEQuantConfig

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
fp8_math = pytest.importorskip("keel_quantization.fp8_math")

E, H, I, TOP_K, BLOCK = 64, 2048, 1408, 6, (128, 128)


@pytest.fixture(scope="module")
def experts():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 MMA needs sm89+")
    gen = torch.Generator(device="cuda").manual_seed(0)

    def stack(n: int, k: int):
        q = (torch.randn(E, n, k, device="cuda", generator=gen) * 64).clamp(-448, 448).to(FP8)
        s = torch.rand(E, n // 128, -(-k // 128), device="cuda", generator=gen) * 2e-4 + 1e-4
        deq = torch.stack([fp8_math.dequantize(q[e], s[e], BLOCK, torch.float32) for e in range(E)])
        return q, s, deq

    q13, s13, d13 = stack(2 * I, H)
    q2, s2, d2 = stack(H, I)
    return q13, q2, d13, d2, FusedMoEQuantConfig("fp8_block", s13, s2, block_shape=BLOCK)


def _routing(tokens: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, H, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(tokens, E, device="cuda", generator=gen).topk(TOP_K, dim=1).indices.to(torch.int32)
    return x, torch.rand(tokens, TOP_K, device="cuda", generator=gen), ids


@pytest.mark.parametrize("tokens", [1, 8, 64, 256, 1024])
def test_engine_tiles_and_each_way_in_match_the_reference(experts, tokens):
    q13, q2, d13, d2, quant = experts
    x, w, ids = _routing(tokens, tokens)
    tiles = get_moe_tile_configs(tokens, tuple(q13.shape), tuple(q2.shape), TOP_K, torch.bfloat16, x.device, False,
                                 fp8_block=BLOCK)
    ways = {tiles[0].a_quant} | ({"none", "load", "launch"} if tiles[0].kernel == "dot" else set())
    for a_quant in sorted(ways):
        cfgs = tuple(fp8_block_tiles(dataclasses.replace(c, a_quant=a_quant), tokens, BLOCK[1]) for c in tiles)
        fake = (lambda t: fp8_math.fake_quant_per_token_group(t, BLOCK[1])) if a_quant != "none" else None
        ref = fused_experts_torch(x.float(), d13, d2, w, ids, quantize_input=fake)
        out = fused_experts_triton(x, q13, q2, w, ids, tile_configs=cfgs, fp8=quant).float()
        # bf16 activations and intermediate; W8A8 re-quantizes the bf16 intermediate, where a rounding apart
        # moves an e4m3 value a step (1/16)
        tol = 3e-2 if a_quant == "none" else 6e-2
        torch.testing.assert_close(out, ref, atol=tol * ref.abs().max().item(), rtol=tol,
                                   msg=f"M={tokens} a_quant {a_quant}")


def test_captured_decode_step_replays_fresh_routing(experts):
    q13, q2, d13, d2, quant = experts
    x, w, ids = _routing(4, 1)

    def step():
        return fused_experts_triton(x, q13, q2, w, ids, fp8=quant)

    graph, out = capture_cuda_graph(step)
    for seed in (2, 3):
        x2, w2, ids2 = _routing(4, seed)
        x.copy_(x2), w.copy_(w2), ids.copy_(ids2)
        graph.replay()
        ref = fused_experts_torch(x.float(), d13, d2, w, ids)
        torch.testing.assert_close(out.float(), ref, atol=3e-2 * ref.abs().max().item(), rtol=3e-2)
