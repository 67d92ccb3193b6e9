"""The fused MoE kernels under the Triton interpreter: explicit tile configs (block_m 16/32/64), the silu
fused into the w2 GEMM's A load, and `moe_sum` (top-k combine + residual), each against torch on fresh
random inputs with idle experts and output buffers poisoned with NaN (every entry must be written)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from keel_kernels_triton.fused_moe import grouped_gemm
from keel_kernels_triton.fused_moe.align import moe_align_block_size
from keel_kernels_triton.fused_moe.grouped_gemm import fused_experts_triton, invoke_fused_moe_kernel
from keel_kernels_triton.fused_moe.moe_sum import moe_sum
from keel_kernels_triton.fused_moe.tile_config import MoETileConfig
from triton_test_utils import BF16_INTERPRETED_TOL, bind_moe_ops, random_moe

from keel.layers.fused_moe import FusedMoE, RoutingConfig, fused_experts_torch

pytestmark = pytest.mark.usefixtures("interpret")


CONFIGS = [
    MoETileConfig(16, 32, 32, 4, 1),
    MoETileConfig(32, 64, 16, 4, 1),
    MoETileConfig(64, 32, 64, 4, 1),  # block_k past K: the masked tail is the whole tile
    MoETileConfig(16, 16, 32, 4, 1, group_m=4),  # grouped program order; groups cut short at the end
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}g{c.group_m}")
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (19, 3)])
def test_explicit_tiles_match_torch(cfg, tokens, top_k):
    x, w13, w2, w, ids = random_moe(tokens + cfg.block_m, tokens, 40, 24, 8, top_k, used=[1, 4, 5, 7])
    ref = fused_experts_torch(x, w13, w2, w, ids)
    out = fused_experts_triton(x, w13, w2, w, ids, tile_configs=(cfg, cfg))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens,top_k,experts", [(7, 2, 8), (1, 1, 4), (19, 3, 6)])
def test_triton_matches_torch_reference(tokens, top_k, experts):
    x, w13, w2, w, ids = random_moe(tokens * 10 + top_k, tokens, 24, 20, experts, top_k)
    ref = fused_experts_torch(x, w13, w2, w, ids)
    out = fused_experts_triton(x, w13, w2, w, ids)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_triton_with_idle_experts_and_all_tokens_on_one_expert():
    x, w13, w2, w, _ = random_moe(3, 18, 16, 12, 8, 2)
    ids = torch.tensor([[6, 2]] * 18)  # six experts receive nothing; 18 rows span two blocks each
    torch.testing.assert_close(
        fused_experts_triton(x, w13, w2, w, ids), fused_experts_torch(x, w13, w2, w, ids), atol=1e-5, rtol=1e-5
    )
    assert torch.equal(fused_experts_triton(x[:0], w13, w2, w[:0], ids[:0]), x[:0])


def test_triton_bf16():
    x, w13, w2, w, ids = random_moe(5, 9, 32, 16, 4, 2, dtype=torch.bfloat16)
    ref = fused_experts_torch(x.float(), w13.float(), w2.float(), w, ids)
    torch.testing.assert_close(fused_experts_triton(x, w13, w2, w, ids).float(), ref, atol=5e-2, rtol=5e-2)


def test_tile_pair_must_share_block_m():
    x, w13, w2, w, ids = random_moe(0, 3, 16, 8, 4, 2)
    with pytest.raises(ValueError, match="one block_m"):
        fused_experts_triton(x, w13, w2, w, ids, tile_configs=(CONFIGS[0], CONFIGS[1]))


def _gemm_pair(gate_up, w2, ids, w, cfg, act_silu):
    """The w2 GEMM on gate_up [rows, 2 * inter], either fused (silu in the A load) or after torch's
    silu-and-mul; the output starts as NaN everywhere."""
    sorted_ids, expert_ids, total = moe_align_block_size(ids, w2.shape[0], cfg.block_m)
    a = gate_up if act_silu else F.silu(gate_up[:, : w2.shape[2]]) * gate_up[:, w2.shape[2]:]
    down = torch.full((gate_up.shape[0], w2.shape[1]), float("nan"), dtype=gate_up.dtype)
    invoke_fused_moe_kernel(a, w2, down, w.reshape(-1).float(), sorted_ids, expert_ids, total, 1, cfg,
                            act_silu=act_silu)
    return down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=lambda c: f"m{c.block_m}")
def test_fused_silu_matches_torch_activation(dtype, cfg):
    tokens, top_k, inter = 13, 2, 24
    _, _, w2, w, ids = random_moe(7, tokens, 32, inter, 6, top_k, dtype, used=[0, 2, 3])
    gen = torch.Generator().manual_seed(11)
    gate_up = (torch.randn(tokens * top_k, 2 * inter, generator=gen) * 3).to(dtype)  # silu's curved range
    fused = _gemm_pair(gate_up, w2, ids, w, cfg, act_silu=True)
    unfused = _gemm_pair(gate_up, w2, ids, w, cfg, act_silu=False)
    assert not fused.isnan().any()
    # float32 agrees to the last bits. The interpreter truncates float32 -> bf16 casts (compiled kernels
    # round to nearest even, as torch does), so bf16 agrees to a couple of ulps here; exact on the GPU.
    if dtype == torch.float32:
        torch.testing.assert_close(fused, unfused, atol=1e-6, rtol=1e-6)
    else:  # the dot of truncated operands: absolute error scales with the outputs' size
        scale = unfused.float().abs().max().item()
        torch.testing.assert_close(fused.float(), unfused.float(), atol=1e-2 * scale, rtol=BF16_INTERPRETED_TOL)


def test_tile_config_can_unfuse_the_activation():
    # fused_act False (prefill tiles): the activation runs before the w2 GEMM, which reads it plainly.
    x, w13, w2, w, ids = random_moe(5, 11, 24, 16, 6, 2, used=[0, 1, 4])
    cfg = MoETileConfig(16, 32, 32, 4, 1)
    calls = []
    real = grouped_gemm.invoke_fused_moe_kernel

    def spy(*args, **kw):
        calls.append(kw.get("act_silu", False))
        return real(*args, **kw)

    ref = fused_experts_torch(x, w13, w2, w, ids)
    for fused in (True, False):
        calls.clear()
        c2 = MoETileConfig(16, 32, 32, 4, 1, fused_act=fused)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(grouped_gemm, "invoke_fused_moe_kernel", spy)
            out = fused_experts_triton(x, w13, w2, w, ids, tile_configs=(cfg, c2))
        assert calls == [False, fused]
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_unfused_activation_keeps_torch_path():
    x, w13, w2, w, ids = random_moe(3, 9, 24, 16, 6, 2, used=[1, 2, 5])
    for act in ("gelu", "gelu_pytorch_tanh", "silu", "swish"):
        ref = fused_experts_torch(x, w13, w2, w, ids, act)
        torch.testing.assert_close(fused_experts_triton(x, w13, w2, w, ids, act), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k,hidden", [(1, 40), (6, 100), (3, 130)])
def test_moe_sum_matches_torch(dtype, top_k, hidden):
    gen = torch.Generator().manual_seed(top_k * hidden)
    down = torch.randn(5, top_k, hidden, generator=gen).to(dtype)
    res = torch.randn(5, hidden, generator=gen).to(dtype)
    out = torch.full((5, hidden), float("nan"), dtype=dtype)
    tol = 1e-6 if dtype == torch.float32 else BF16_INTERPRETED_TOL  # see test_fused_silu_matches_torch_activation
    assert moe_sum(down, out) is out
    torch.testing.assert_close(out, down.sum(1), atol=tol, rtol=tol)
    out.fill_(float("nan"))
    moe_sum(down, out, residual=res)
    torch.testing.assert_close(out, down.sum(1) + res, atol=tol, rtol=tol)
    assert moe_sum(down[:0]).shape == (0, hidden)


def test_moe_sum_rejects_bad_shapes():
    with pytest.raises(ValueError, match="tokens, top_k, hidden"):
        moe_sum(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="residual"):
        moe_sum(torch.zeros(4, 2, 8), residual=torch.zeros(4, 9))


@pytest.mark.parametrize("bound", [True, False])
def test_layer_residual_equals_separate_add(bound):
    routing = RoutingConfig(num_experts=6, top_k=2, renormalize=True)
    layer = FusedMoE(6, 16, 8, routing)
    if bound:
        assert bind_moe_ops(layer) == {"select_experts": 1, "fused_experts": 1}
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        layer.w13_weight.copy_(torch.randn(6, 16, 16, generator=gen) / 4)
        layer.w2_weight.copy_(torch.randn(6, 16, 8, generator=gen) / 3)
    x, logits, res = torch.randn(7, 16, generator=gen), torch.randn(7, 6, generator=gen), torch.randn(7, 16)
    torch.testing.assert_close(layer(x, logits, residual=res), layer(x, logits) + res, atol=1e-6, rtol=1e-6)
    empty = layer(x[:0], logits[:0], residual=res[:0])
    assert empty.shape == (0, 16)


def test_default_path_takes_tiles_from_lookup(monkeypatch):
    x, w13, w2, w, ids = random_moe(5, 6, 24, 16, 8, 2)
    seen = {}

    def lookup(num_tokens, w13_shape, w2_shape, top_k, dtype, device, interpret):
        seen["args"] = (num_tokens, w13_shape, w2_shape, top_k, dtype, device.type, interpret)
        return CONFIGS[1], CONFIGS[1]

    real_align = grouped_gemm.moe_align_block_size
    monkeypatch.setattr(grouped_gemm, "get_moe_tile_configs", lookup)
    monkeypatch.setattr(grouped_gemm, "moe_align_block_size",
                        lambda ids_, e, block_m: seen.setdefault("block_m", block_m) and real_align(ids_, e, block_m))
    out = fused_experts_triton(x, w13, w2, w, ids)
    assert seen["args"] == (6, (8, 32, 24), (8, 24, 16), 2, torch.float32, "cpu", True)
    assert seen["block_m"] == CONFIGS[1].block_m
    torch.testing.assert_close(out, fused_experts_torch(x, w13, w2, w, ids), atol=1e-5, rtol=1e-5)
