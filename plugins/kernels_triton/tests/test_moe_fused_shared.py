"""A `FusedMoE` with fused shared experts, kernels-triton's ops bound, against the same layer's routed experts
plus the separate shared MLP: through the grouped GEMM (steps up to FUSED_SHARED_MAX_TOKENS) and as dense
GEMMs over the fused slots (larger steps). Interpreted on the CPU in float32; compiled on CUDA in bf16, also
replayed from a CUDA graph with fresh inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_test_utils import bind_moe_ops, capture_cuda_graph

from keel.layers.fused_moe import FusedMoE, RoutingConfig
from keel.layers.fused_moe.layer import FUSED_SHARED_MAX_TOKENS

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _pair(experts, shared, hidden, inter, top_k, device, dtype):
    """(fused layer, routed-only layer on the same weights, the separate shared MLP as a function)."""
    routing = RoutingConfig(num_experts=experts, top_k=top_k, renormalize=True, routed_scaling_factor=2.5)
    fused = FusedMoE(experts, hidden, inter, RoutingConfig(**{**routing.__dict__, "num_fused_shared_experts": shared}))
    plain = FusedMoE(experts, hidden, inter, routing)
    gen = torch.Generator().manual_seed(experts + shared)
    with torch.no_grad():
        fused.w13_weight.copy_(torch.randn(fused.w13_weight.shape, generator=gen) / hidden**0.5)
        fused.w2_weight.copy_(torch.randn(fused.w2_weight.shape, generator=gen) / inter**0.5)
        plain.w13_weight.copy_(fused.w13_weight[:experts])
        plain.w2_weight.copy_(fused.w2_weight[:experts])
    fused.to(device, dtype)
    plain.to(device, dtype)
    bind_moe_ops(fused, device)
    bind_moe_ops(plain, device)
    slots = range(experts, experts + shared)
    gate_up = torch.cat([fused.w13_weight[s, :inter] for s in slots] + [fused.w13_weight[s, inter:] for s in slots])
    down = torch.cat([fused.w2_weight[s] for s in slots], dim=1)

    def shared_mlp(x):  # float32, as the reference
        g, u = F.linear(x.float(), gate_up.float()).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, down.float())

    return fused, plain, shared_mlp


def _check(fused, plain, shared_mlp, x, logits, tol):
    with torch.no_grad():
        got = fused(x, logits).float()
        want = plain(x, logits).float() + shared_mlp(x)
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("shared", [1, 2])
def test_interpreted_fused_shared_experts(interpret, shared):
    fused, plain, shared_mlp = _pair(8, shared, 32, 16, 2, "cpu", torch.float32)
    assert fused.bound_ops.keys() == {"select_experts", "fused_experts"}
    for tokens in (3, FUSED_SHARED_MAX_TOKENS + 5):
        gen = torch.Generator().manual_seed(tokens)
        _check(fused, plain, shared_mlp, torch.randn(tokens, 32, generator=gen), torch.randn(tokens, 8, generator=gen),
               1e-5)
    assert fused.shared_act.bound_ops.keys() == {"silu_and_mul"}  # the dense steps' activation kernel


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 4, FUSED_SHARED_MAX_TOKENS, FUSED_SHARED_MAX_TOKENS + 7, 300])
def test_cuda_fused_shared_experts(tokens):
    fused, plain, shared_mlp = _pair(64, 2, 512, 256, 6, "cuda", torch.bfloat16)  # V2-Lite's routing shape
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 512, device="cuda", generator=gen).bfloat16()
    _check(fused, plain, shared_mlp, x, torch.randn(tokens, 64, device="cuda", generator=gen), 2e-2)


@needs_cuda
@pytest.mark.parametrize("tokens", [2, FUSED_SHARED_MAX_TOKENS + 7, 256])
def test_cuda_graph_replay_of_fused_shared_experts(tokens):
    """Past FUSED_SHARED_MAX_TOKENS the captured graph runs the dense shared experts on a side stream
    (`keel.layers.side_stream`): its replays equal the eager forward bit for bit (same kernels, same rounding)."""
    fused, plain, shared_mlp = _pair(64, 2, 512, 256, 6, "cuda", torch.bfloat16)
    x = torch.randn(tokens, 512, device="cuda").bfloat16()
    logits = torch.randn(tokens, 64, device="cuda")
    graph, out = capture_cuda_graph(lambda: fused(x, logits))
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(tokens, 512, device="cuda", generator=gen))
        logits.copy_(torch.randn(tokens, 64, device="cuda", generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        want = plain(x, logits).float() + shared_mlp(x)
        torch.testing.assert_close(out.float(), want, atol=2e-2 * want.abs().max().item(), rtol=0)
        with torch.no_grad():
            assert torch.equal(out, fused(x, logits))
