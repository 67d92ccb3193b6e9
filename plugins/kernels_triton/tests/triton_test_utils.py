"""Test-only helpers of kernels-triton's tests: random MoE inputs, sm_90 compile checks without a GPU,
CUDA-graph capture, and binding the plugin's MoE ops into a `FusedMoE` layer the way the worker does."""

from __future__ import annotations

import torch

from keel.layers.custom_op import bind_custom_ops
from keel.plugins.loader import load_plugins
from keel.testing.sm90_compile import run_sm90_compile_script

__all__ = ["run_sm90_compile_script"]

# The interpreter truncates float32 -> bf16 casts (compiled kernels round to nearest even, as torch does):
# interpreted bf16 results agree with torch to a couple of ulps.
BF16_INTERPRETED_TOL = 2e-2


def random_moe(seed, tokens, hidden, inter, experts, top_k, dtype=torch.float32, used=None):
    """Random weights and routing; only the experts in `used` (default: all) receive tokens."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    w = torch.rand(tokens, top_k, generator=gen)
    pool = torch.tensor(used if used is not None else range(experts))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:top_k]] for _ in range(tokens)])
    return x, w13, w2, w, ids


def bind_moe_ops(layer: torch.nn.Module, device_type: str = "cpu") -> dict[str, int]:
    """Bind kernels-triton's providers into `layer` (and its children) through the core's binding step."""
    registry = load_plugins(["kernels-triton"]).registry("custom_op")
    return bind_custom_ops(layer, registry, device_type, layer.w13_weight.dtype)


def capture_cuda_graph(step):
    """Run `step` once on a side stream (compiles, settles the allocator), then capture it; returns
    (graph, the outputs of the captured call). CUDA only."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs
