"""The router-logits kernel (kernels-triton's fused_moe/router_gemm.py) against a float64 reference.

Interpreted on the CPU (TRITON_INTERPRET=1), small odd shapes through both launch shapes (the reduction
path up to SMALL_T tokens, tl.dot tiles above, large-step tiles past 512 tokens), outputs poisoned first;
compiled for sm_90 in test_moe_routing_align_gpu.py, run on CUDA below where a GPU is present.
"""

from __future__ import annotations

import pytest
import torch
from keel_kernels_triton.fused_moe.ops import TritonRouterGemm
from keel_kernels_triton.fused_moe.router_gemm import SMALL_T, router_gemm_launch, router_gemm_triton

from keel.layers.custom_op import bind_custom_ops
from keel.plugins.loader import load_plugins

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _inputs(tokens, experts, k, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    w = torch.randn(experts, k, generator=gen) / k**0.5
    return x.to(device), w.to(device)


def _check(tokens, experts, k, dtype, seed, device="cpu"):
    x, w = _inputs(tokens, experts, k, dtype, seed, device)
    out = torch.full((tokens, experts), float("nan"), device=device)
    got = router_gemm_triton(x, w, out=out)
    assert got is out
    ref = x.double() @ w.double().t()
    # float32 products of exact (widened) inputs, float32 sums: error ~ sqrt(k) ulps of the partial sums
    torch.testing.assert_close(got.double(), ref, atol=2e-5 * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 2, 3, SMALL_T, SMALL_T + 1, 37])
@pytest.mark.parametrize("experts,k", [(64, 256), (7, 33), (60, 100)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_float64_reference(interpret, tokens, experts, k, dtype):
    _check(tokens, experts, k, dtype, seed=tokens * 7 + experts + k)


def test_large_step_tiles_and_strided_x(interpret):
    assert router_gemm_launch(600, 20, 40)["BLOCK_T"] == 64  # the prefill tile
    _check(600, 20, 40, torch.bfloat16, seed=3)
    x, w = _inputs(5, 12, 48, torch.bfloat16, seed=4)
    wide = torch.cat([x, x], dim=1)[:, 48:]  # row stride 96
    torch.testing.assert_close(router_gemm_triton(wide, w), x.float() @ w.t(), atol=1e-5, rtol=1e-5)


def test_empty_batch_and_user_errors(interpret):
    assert router_gemm_triton(torch.randn(0, 16), torch.randn(8, 16)).shape == (0, 8)
    with pytest.raises(ValueError, match="float32"):
        router_gemm_triton(torch.randn(2, 16), torch.randn(8, 16).bfloat16())
    with pytest.raises(ValueError, match="weight"):
        router_gemm_triton(torch.randn(2, 16), torch.randn(8, 15))
    with pytest.raises(ValueError, match="out"):
        router_gemm_triton(torch.randn(2, 16), torch.randn(8, 16), out=torch.empty(2, 7))


class _Gate(torch.nn.Module):
    custom_ops = ("router_gemm",)

    def __init__(self, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 16, dtype=dtype), requires_grad=False)


def test_op_binds_float32_gates_only(interpret):
    registry = load_plugins(["kernels-triton"]).registry("custom_op")
    assert registry.get("router_gemm") is TritonRouterGemm
    gate, low = _Gate(torch.float32), _Gate(torch.bfloat16)
    assert bind_custom_ops(gate, registry, "cpu", torch.bfloat16) == {"router_gemm": 1}
    assert bind_custom_ops(low, registry, "cpu", torch.bfloat16) == {}  # declined: not a float32 router
    x = torch.randn(3, 16).bfloat16()
    torch.testing.assert_close(gate.bound_ops["router_gemm"](x, gate.weight), x.float() @ gate.weight.t())


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 4, 8, 16, 256, 2000, 4100])
@pytest.mark.parametrize("experts,k", [(64, 2048), (256, 7168)])  # DeepSeek-V2-Lite, V3
def test_cuda_matches_float64_reference(tokens, experts, k):
    _check(tokens, experts, k, torch.bfloat16, seed=tokens, device="cuda")


def test_op_runs_the_kernel_only_where_it_is_faster(interpret, monkeypatch):
    """The op launches the kernel for bf16 activations at every size and for other dtypes up to
    ROUTER_KERNEL_MAX_TOKENS tokens (measured faster there), the reference computation past it."""
    from keel_kernels_triton.fused_moe import ops

    calls = []
    monkeypatch.setattr(ops, "router_gemm_triton", lambda x, w: calls.append(x.shape[0]) or x.float() @ w.t())
    op = TritonRouterGemm()
    small = ops.ROUTER_KERNEL_MAX_TOKENS
    for dtype in (torch.float16, torch.bfloat16):
        for tokens in (1, small, small + 1, 300):
            x, w = _inputs(tokens, 16, 32, dtype, seed=tokens)
            assert torch.equal(op(x, w), torch.nn.functional.linear(x.float(), w))
    assert calls == [1, small, 1, small, small + 1, 300]


@pytest.mark.parametrize("tokens,experts,k", [(SMALL_T + 1, 20, 1000), (40, 70, 700), (600, 20, 300)])
def test_split_k_partials_sum_in_slice_order(interpret, tokens, experts, k):
    """bf16 steps split K across programs (float32 partials per slice, moe_sum adds them): odd K (a short
    last slice), experts past one tile, the large-step tile; the same bound as the unsplit path."""
    launch = router_gemm_launch(tokens, experts, k, split_w=True)
    assert launch["K_SLICE"] < k and launch["K_SLICE"] % launch["BLOCK_K"] == 0
    _check(tokens, experts, k, torch.bfloat16, seed=k)


@pytest.mark.parametrize("tokens", [SMALL_T + 1, 600])
def test_split_weight_path_is_float32_exact_up_to_summation_order(interpret, tokens):
    """bf16 activations past SMALL_T tokens: the float32 gate split into three bf16 parts (hi + mid + lo ==
    w exactly) through bf16 dots. Every product is exact, so the error is float32 summation only -- far
    below what dropping the low parts (a plain bf16 gate) costs."""
    experts, k = 20, 96
    assert router_gemm_launch(tokens, experts, k, split_w=True)["SPLIT_W"]
    x, w = _inputs(tokens, experts, k, torch.bfloat16, seed=tokens)
    w = w * (1 + torch.rand_like(w) * 2**-12)  # every one of the 24 mantissa bits in play
    got = router_gemm_triton(x, w).double()
    ref = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    bound = 2 * k * 2**-24 * scale + 1e-30  # float32 accumulation of k exact products, either order
    assert ((got - ref).abs() <= bound).all()
    dropped = (x.double() @ w.bfloat16().double().t() - ref).abs()
    assert (dropped > bound).float().mean() > 0.5  # the mid and lo parts carry real bits


def test_split_weight_parts_reassemble_the_weight_exactly():
    """The decomposition the kernel does in registers, in torch: w == hi + mid + lo for float32 w from
    2^-110 up to float32's largest (bf16 has float32's exponent range), however the casts round. Below
    2^-110 the last part's low bits fall under bf16's smallest subnormal (randn * 1e-30 drew such values in
    2.5% of seeds: the unseeded test failed at random); a router gate's weights are ~1e-2."""
    gen = torch.Generator().manual_seed(0)
    tiny = (torch.rand(64, generator=gen) + 2**-110 / 1e-30) * 1e-30 * torch.randn(64, generator=gen).sign()
    w = torch.cat([torch.randn(4096, generator=gen), tiny, torch.randn(64, generator=gen) * 1e30,
                   torch.tensor([2**-110, -(2**-110), 0.0, -0.0])])
    hi = w.bfloat16()
    rest = w - hi.float()
    mid = rest.bfloat16()
    lo = (rest - mid.float()).bfloat16()
    assert torch.equal(hi.double() + mid.double() + lo.double(), w.double())


@pytest.mark.parametrize("experts,k", [(64, 2048), (256, 7168), (160, 5120)])  # DSV2-Lite, V3, V2
@pytest.mark.parametrize("split_w", [True, False])
def test_the_startup_warm_up_meets_every_launch_variant(experts, k, split_w):
    """Each launch variant (its constexprs: a compile each) a step of 1 .. max_num_batched_tokens tokens can
    take is taken at one of the warm-up's prefill sizes; at 22b91ee split counts of 3, 5, 6 and 7 were not,
    and compiled in the first big batch (DSV2-Lite's round 1 at 0.91x its round 2 on an H100)."""
    from keel.testing.warm_up import assert_warm_up_meets

    def variant(t):
        return tuple(sorted(router_gemm_launch(t, experts, k, split_w=split_w).items()))

    for max_tokens in (8192, 2048, 16384):
        assert_warm_up_meets(variant, max_tokens, f"router_gemm E={experts} K={k}")
