"""The one-kernel MoE routing (kernels-triton's fused_moe/routing.py) against the core's torch routing.

Interpreted on the CPU (TRITON_INTERPRET=1, one program per token executed in numpy), so shapes stay small.
Logits are continuous random values: ties, whose order torch.topk leaves open, do not occur, so ids must
match exactly and in the same (descending score) order.
"""

from __future__ import annotations

import pytest
import torch
from keel_kernels_triton.fused_moe.ops import TritonSelectExperts
from keel_kernels_triton.fused_moe.routing import routing_triton_supported, select_experts_triton
from triton_test_utils import bind_moe_ops

from keel.layers.fused_moe import FusedMoE, RoutingConfig, RoutingConfigError, select_experts


def _check(cfg: RoutingConfig, tokens: int, seed: int, with_bias: bool = False) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, cfg.num_experts, generator=gen) * 2.0
    bias = torch.randn(cfg.num_experts, generator=gen) * 0.3 if with_bias else None
    assert routing_triton_supported(cfg)
    w, ids = select_experts_triton(logits, cfg, bias)
    ref_w, ref_ids = select_experts(logits, cfg, bias)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-6)


V2_GREEDY = [
    RoutingConfig(num_experts=8, top_k=2),
    RoutingConfig(num_experts=60, top_k=6),
    RoutingConfig(num_experts=64, top_k=6, renormalize=True, routed_scaling_factor=1.0),
    RoutingConfig(num_experts=60, top_k=6, renormalize=True, routed_scaling_factor=16.0),
    RoutingConfig(num_experts=5, top_k=5),  # every expert chosen
    RoutingConfig(num_experts=60, top_k=4, scoring_func="sigmoid", routed_scaling_factor=2.5),
]


@pytest.mark.parametrize("cfg", V2_GREEDY, ids=lambda c: f"E{c.num_experts}k{c.top_k}{c.scoring_func}")
@pytest.mark.parametrize("tokens", [1, 3, 70])
def test_greedy_matches_torch(interpret, cfg, tokens):
    _check(cfg, tokens, seed=tokens + cfg.num_experts)


@pytest.mark.parametrize(
    "experts,groups,keep,top_k",
    [(60, 4, 2, 6), (60, 6, 3, 6), (64, 8, 3, 6), (72, 8, 4, 8), (8, 4, 1, 2)],
)
@pytest.mark.parametrize("renormalize", [False, True])
def test_v2_softmax_group_limited_matches_torch(interpret, experts, groups, keep, top_k, renormalize):
    cfg = RoutingConfig(num_experts=experts, top_k=top_k, use_grouped_topk=True, num_expert_group=groups,
                        topk_group=keep, renormalize=renormalize, routed_scaling_factor=1.7)
    for tokens in (1, 17):
        _check(cfg, tokens, seed=experts * groups + tokens)


@pytest.mark.parametrize(
    "experts,groups,keep,top_k",
    [(60, 4, 2, 6), (60, 6, 3, 6), (64, 8, 4, 8), (256, 8, 4, 8), (8, 1, 1, 2)],
)
@pytest.mark.parametrize("renormalize", [False, True])
def test_v3_sigmoid_bias_group_limited_matches_torch(interpret, experts, groups, keep, top_k, renormalize):
    cfg = RoutingConfig(num_experts=experts, top_k=top_k, scoring_func="sigmoid", use_grouped_topk=True,
                        num_expert_group=groups, topk_group=keep, renormalize=renormalize,
                        routed_scaling_factor=2.5)
    for tokens in (1, 9):
        _check(cfg, tokens, seed=experts + groups + tokens, with_bias=True)


def test_v3_many_tokens(interpret):
    cfg = RoutingConfig(num_experts=60, top_k=6, scoring_func="sigmoid", use_grouped_topk=True,
                        num_expert_group=4, topk_group=2, renormalize=True, routed_scaling_factor=2.5)
    _check(cfg, 70, seed=11, with_bias=True)


def test_group_limit_and_bias_semantics(interpret):
    cfg = RoutingConfig(num_experts=8, top_k=2, use_grouped_topk=True, num_expert_group=4, topk_group=1)
    logits = torch.tensor([[0.0, 5.0, 4.9, 0.0, 0.0, 0.0, 0.0, 4.8]])  # experts 1 and 2 sit in different groups
    assert sorted(select_experts_triton(logits, cfg)[1][0].tolist()) == [0, 1]
    cfg = RoutingConfig(num_experts=4, top_k=1, scoring_func="sigmoid", use_grouped_topk=True,
                        num_expert_group=1, topk_group=1)
    w, ids = select_experts_triton(torch.tensor([[2.0, 0.0, 0.0, 0.0]]), cfg, torch.tensor([0.0, 0.0, 0.0, 1.0]))
    assert ids.tolist() == [[3]]  # the bias picks the expert ...
    torch.testing.assert_close(w, torch.sigmoid(torch.tensor([[0.0]])))  # ... but does not weigh it


def test_ties_go_to_the_lowest_index(interpret):
    cfg = RoutingConfig(num_experts=6, top_k=2)
    _, ids = select_experts_triton(torch.tensor([[1.0, 3.0, 0.0, 3.0, 3.0, 2.0]]), cfg)
    assert ids.tolist() == [[1, 3]]
    grouped = RoutingConfig(num_experts=8, top_k=2, use_grouped_topk=True, num_expert_group=4, topk_group=1)
    _, ids = select_experts_triton(torch.tensor([[0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]]), grouped)
    assert ids.tolist() == [[1, 0]]  # groups 0, 2 and 3 tie: group 0 wins


def test_every_output_entry_is_written_and_strided_logits(interpret):
    cfg = RoutingConfig(num_experts=12, top_k=3, renormalize=True)
    wide = torch.randn(5, 20)
    logits = wide[:, 4:16]  # unit stride over experts, row stride 20
    poisoned = (torch.full((5, 3), float("nan")), torch.full((5, 3), -7, dtype=torch.int32))
    w, ids = select_experts_triton(logits, cfg, out=poisoned)
    assert w is poisoned[0] and ids is poisoned[1]
    ref_w, ref_ids = select_experts(logits, cfg)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(select_experts_triton(logits.t().contiguous().t(), cfg)[0], ref_w)
    with pytest.raises(ValueError, match="routing buffers"):
        select_experts_triton(logits, cfg, out=(poisoned[0][:4], poisoned[1]))


def test_empty_batch_and_bf16_logits(interpret):
    cfg = RoutingConfig(num_experts=8, top_k=2)
    w, ids = select_experts_triton(torch.randn(0, 8), cfg)
    assert w.shape == (0, 2) and ids.shape == (0, 2)
    logits = torch.randn(4, 8).bfloat16()
    _, ids = select_experts_triton(logits, cfg)
    assert torch.equal(ids.long(), select_experts(logits, cfg)[1])


def test_user_errors_and_unsupported_configs():
    cfg = RoutingConfig(num_experts=8, top_k=2)
    with pytest.raises(RoutingConfigError, match="e_score_correction_bias"):
        select_experts_triton(torch.randn(2, 8), cfg, torch.zeros(8))
    with pytest.raises(RoutingConfigError, match="experts"):
        select_experts_triton(torch.randn(2, 9), cfg)
    one_per_group = RoutingConfig(num_experts=8, top_k=2, scoring_func="sigmoid", use_grouped_topk=True,
                                  num_expert_group=8, topk_group=2)
    assert not routing_triton_supported(one_per_group)  # torch's top-2 group score raises there
    assert not routing_triton_supported(RoutingConfig(num_experts=4096, top_k=8))
    assert routing_triton_supported(RoutingConfig(num_experts=256, top_k=8))


def test_select_experts_op_declines_unsupported_routing_at_bind_time(interpret):
    cfg = RoutingConfig(num_experts=4, top_k=2, scoring_func="sigmoid", use_grouped_topk=True,
                        num_expert_group=4, topk_group=2)
    layer = FusedMoE(4, 16, 8, cfg)
    assert bind_moe_ops(layer) == {"fused_experts": 1}  # routing declined: the layer keeps torch routing
    with torch.no_grad():
        layer.w13_weight.normal_()
        layer.w2_weight.normal_()
    with pytest.raises(RuntimeError):  # torch's top-2 of one-expert groups: the reference's own error
        layer(torch.randn(2, 16), torch.randn(2, 4), torch.zeros(4))


def test_bound_layer_routes_with_the_kernel(interpret, monkeypatch):
    cfg = RoutingConfig(num_experts=6, top_k=2, scoring_func="sigmoid", use_grouped_topk=True,
                        num_expert_group=3, topk_group=2, renormalize=True)
    layer = FusedMoE(6, 16, 8, cfg, prefix="mlp.experts")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.w13_weight.copy_(torch.randn(layer.w13_weight.shape, generator=gen) / 4)
        layer.w2_weight.copy_(torch.randn(layer.w2_weight.shape, generator=gen) / 3)
    x, logits, bias = torch.randn(5, 16), torch.randn(5, 6), torch.randn(6) * 0.2
    ref = layer(x, logits, bias)  # unbound: torch routing and experts
    calls = []
    real = TritonSelectExperts.__call__
    monkeypatch.setattr(TritonSelectExperts, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    assert bind_moe_ops(layer) == {"select_experts": 1, "fused_experts": 1}
    torch.testing.assert_close(layer(x, logits, bias), ref, atol=1e-5, rtol=1e-5)
    assert calls == [1]


@pytest.mark.parametrize("cfg,with_bias", [
    (RoutingConfig(num_experts=64, top_k=6, num_fused_shared_experts=2, routed_scaling_factor=1.5), False),
    (RoutingConfig(num_experts=60, top_k=4, num_fused_shared_experts=3, use_grouped_topk=True, num_expert_group=4,
                   topk_group=2, renormalize=True, routed_scaling_factor=16.0), False),
    (RoutingConfig(num_experts=32, top_k=8, num_fused_shared_experts=1, scoring_func="sigmoid",
                   use_grouped_topk=True, num_expert_group=8, topk_group=4, renormalize=True,
                   routed_scaling_factor=2.5), True),  # V3's one shared expert
], ids=["v2-greedy", "v2-grouped", "v3"])
def test_fused_shared_experts_are_appended_with_weight_one(interpret, cfg, with_bias):
    for tokens in (1, 5):
        _check(cfg, tokens, seed=tokens + cfg.num_fused_shared_experts, with_bias=with_bias)
    logits = torch.randn(3, cfg.num_experts)
    bias = torch.randn(cfg.num_experts) * 0.3 if with_bias else None
    poisoned = (torch.full((3, cfg.num_routes), float("nan")), torch.full((3, cfg.num_routes), -7, dtype=torch.int32))
    w, ids = select_experts_triton(logits, cfg, bias, out=poisoned)
    shared = torch.arange(cfg.num_experts, cfg.num_experts + cfg.num_fused_shared_experts)
    assert torch.equal(ids[:, cfg.top_k:].long(), shared.expand(3, -1))
    assert torch.equal(w[:, cfg.top_k:], torch.ones(3, cfg.num_fused_shared_experts))  # not scaled
    routed = RoutingConfig(**{**cfg.__dict__, "num_fused_shared_experts": 0})
    ref_w, ref_ids = select_experts(logits, routed, bias)
    assert torch.equal(ids[:, :cfg.top_k].long(), ref_ids)
    torch.testing.assert_close(w[:, :cfg.top_k], ref_w, atol=1e-6, rtol=1e-6)
