"""MoE routing (keel.layers.fused_moe.router) against transformers' DeepSeek-V2/V3 routers."""

from __future__ import annotations

import pytest
import torch
from deepseek_test_utils import tiny_deepseek_config
from keel_models_deepseek.moe import routing_config

from keel.layers.fused_moe import RoutingConfig, RoutingConfigError, fused_topk, grouped_topk, select_experts


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def _compare_with_hf(router, cfg: RoutingConfig, x: torch.Tensor, bias: torch.Tensor | None) -> None:
    _, ref_w, ref_ids = router(x)
    w, ids = select_experts(torch.nn.functional.linear(x, router.weight), cfg, bias)
    ref_w, ref_ids = _sorted(ref_w, ref_ids)
    w, ids = _sorted(w, ids)
    assert torch.equal(ids, ref_ids.long())
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=0)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_softmax_routing_matches_hf(method):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    hf = tiny_deepseek_config(2, topk_method=method, n_group=4, topk_group=2, routed_scaling_factor=1.7)
    router = DeepseekV2TopkRouter(hf)
    torch.nn.init.normal_(router.weight, std=0.3)
    x = torch.randn(33, hf.hidden_size)
    cfg = routing_config(hf, 2)
    assert cfg.use_grouped_topk == (method == "group_limited_greedy") and cfg.scoring_func == "softmax"
    _compare_with_hf(router, cfg, x, None)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_v3_sigmoid_bias_grouped_routing_matches_hf(norm_topk_prob):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf = tiny_deepseek_config(3, norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(hf)
    torch.nn.init.normal_(router.weight, std=0.3)
    router.e_score_correction_bias.copy_(torch.randn(hf.n_routed_experts) * 0.2)
    cfg = routing_config(hf, 3)
    assert cfg.scoring_func == "sigmoid" and cfg.use_grouped_topk and cfg.renormalize == norm_topk_prob
    _compare_with_hf(router, cfg, torch.randn(33, hf.hidden_size), router.e_score_correction_bias)


def test_group_limit_keeps_experts_inside_chosen_groups():
    cfg = RoutingConfig(num_experts=8, top_k=2, use_grouped_topk=True, num_expert_group=4, topk_group=1)
    logits = torch.tensor([[0.0, 5.0, 4.9, 0.0, 0.0, 0.0, 0.0, 4.8]])  # experts 1 and 2 sit in different groups
    _, ids = grouped_topk(logits, cfg)
    assert sorted(ids[0].tolist()) == [0, 1]  # only group 0 (experts 0, 1) survives
    _, greedy = fused_topk(logits, RoutingConfig(num_experts=8, top_k=2))
    assert sorted(greedy[0].tolist()) == [1, 2]


def test_bias_picks_experts_but_does_not_weigh_them():
    cfg = RoutingConfig(num_experts=4, top_k=1, scoring_func="sigmoid", use_grouped_topk=True,
                        num_expert_group=1, topk_group=1)
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])
    w, ids = grouped_topk(logits, cfg, bias)
    assert ids.tolist() == [[3]]
    torch.testing.assert_close(w, torch.sigmoid(torch.tensor([[0.0]])))


def test_renormalize_and_scaling():
    logits = torch.randn(5, 8)
    w, _ = fused_topk(logits, RoutingConfig(num_experts=8, top_k=3, renormalize=True, routed_scaling_factor=2.0))
    torch.testing.assert_close(w.sum(-1), torch.full((5,), 2.0))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_experts": 8, "top_k": 9},
        {"num_experts": 8, "top_k": 2, "scoring_func": "relu"},
        {"num_experts": 8, "top_k": 2, "use_grouped_topk": True, "num_expert_group": 3, "topk_group": 1},
        {"num_experts": 8, "top_k": 2, "use_grouped_topk": True, "num_expert_group": 4, "topk_group": 5},
        {"num_experts": 8, "top_k": 4, "use_grouped_topk": True, "num_expert_group": 4, "topk_group": 1},
    ],
)
def test_bad_routing_configs_are_typed_errors(kwargs):
    with pytest.raises(RoutingConfigError):
        RoutingConfig(**kwargs)


def test_unknown_v2_topk_method_is_rejected():
    with pytest.raises(ValueError, match="topk_method"):
        routing_config(tiny_deepseek_config(2, topk_method="noaux_tc"), 2)
