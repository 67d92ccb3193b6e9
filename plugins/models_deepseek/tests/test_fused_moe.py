"""FusedMoE (core): expert weight loading, the torch alignment reference, and the bound-op dispatch.

The Triton kernels' own tests live with them in plugins/kernels_triton/tests.
"""

from __future__ import annotations

import pytest
import torch

from keel.layers.fused_moe import (
    FusedMoE,
    FusedMoEParallelConfig,
    RoutingConfig,
    fused_experts_torch,
    moe_align_block_size_torch,
)
from keel.layers.fused_moe.layer import FUSED_SHARED_MAX_TOKENS
from keel.models.weights import WeightLoadError, load_mapped_weights


def test_align_block_size_groups_rows_by_expert():
    ids = torch.tensor([[3, 0], [0, 5], [3, 5], [0, 3]])
    sorted_ids, expert_ids, total = moe_align_block_size_torch(ids, num_experts=8, block_m=4)
    n = int(total)
    assert n == 12  # experts 0, 3, 5 -> three blocks of 4; experts without tokens get none
    flat = ids.reshape(-1)
    real = sorted_ids[:n]
    for b in range(n // 4):
        rows = real[b * 4 : (b + 1) * 4]
        rows = rows[rows < flat.numel()]
        assert (flat[rows.long()] == expert_ids[b]).all()
    assert sorted(real[real < flat.numel()].tolist()) == list(range(flat.numel()))
    assert (sorted_ids[n:] == flat.numel()).all()


def _layer(experts=4, hidden=16, inter=8):
    routing = RoutingConfig(num_experts=experts, top_k=2, renormalize=True)
    return FusedMoE(experts, hidden, inter, routing, prefix="mlp.experts")


def _per_expert_checkpoint(experts=4, hidden=16, inter=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ckpt = {}
    for e in range(experts):
        ckpt[f"mlp.experts.{e}.gate_proj.weight"] = torch.randn(inter, hidden, generator=g)
        ckpt[f"mlp.experts.{e}.up_proj.weight"] = torch.randn(inter, hidden, generator=g)
        ckpt[f"mlp.experts.{e}.down_proj.weight"] = torch.randn(hidden, inter, generator=g)
    return ckpt


class _Block(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.experts = layer


def test_per_expert_tensors_stack_through_weight_loader():
    block = _Block(_layer())
    ckpt = _per_expert_checkpoint()
    loaded = load_mapped_weights(block, ckpt.items(), FusedMoE.make_expert_params_mapping(4))
    assert loaded == {"mlp.experts.w13_weight", "mlp.experts.w2_weight"}
    layer = block.mlp.experts
    assert torch.equal(layer.w13_weight[2, :8], ckpt["mlp.experts.2.gate_proj.weight"])
    assert torch.equal(layer.w13_weight[2, 8:], ckpt["mlp.experts.2.up_proj.weight"])
    assert torch.equal(layer.w2_weight[3], ckpt["mlp.experts.3.down_proj.weight"])


def test_missing_expert_leaves_parameter_unloaded_and_bad_shapes_raise():
    block = _Block(_layer())
    ckpt = _per_expert_checkpoint()
    del ckpt["mlp.experts.1.up_proj.weight"]
    loaded = load_mapped_weights(block, ckpt.items(), FusedMoE.make_expert_params_mapping(4))
    assert loaded == {"mlp.experts.w2_weight"}  # w13 lacks expert 1's up shard
    ckpt = _per_expert_checkpoint()
    ckpt["mlp.experts.0.down_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(WeightLoadError, match="experts.0.down_proj"):
        load_mapped_weights(block, ckpt.items(), FusedMoE.make_expert_params_mapping(4))
    with pytest.raises(WeightLoadError, match="shard id"):
        block.mlp.experts.weight_loader(block.mlp.experts.w2_weight, torch.zeros(16, 8), (0, "w1"))


def test_bound_ops_replace_routing_and_experts():
    layer = _layer()
    assert FusedMoE.custom_ops == ("select_experts", "fused_experts") and not layer.bound_ops
    load_mapped_weights(_Block(layer), _per_expert_checkpoint().items(), FusedMoE.make_expert_params_mapping(4))
    x, logits, res = torch.randn(5, 16), torch.randn(5, 4), torch.randn(5, 16)
    ref = layer(x, logits, residual=res)  # unbound: the torch reference
    calls = []

    def route(logits_, routing, bias):
        calls.append(("route", routing is layer.routing, bias))
        w, ids = torch.topk(torch.softmax(logits_.float(), -1), 2)
        return w / w.sum(-1, keepdim=True), ids.to(torch.int32)

    def experts(hidden, w13, w2, w, ids, activation, residual):
        calls.append(("experts", w13 is layer.w13_weight, activation))
        return fused_experts_torch(hidden, w13, w2, w, ids, activation) + residual

    layer.bound_ops = {"select_experts": route, "fused_experts": experts}
    torch.testing.assert_close(layer(x, logits, residual=res), ref)
    assert calls == [("route", True, None), ("experts", True, "silu")]


def _shared_checkpoint(shared, hidden=16, inter=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"mlp.shared_experts.gate_proj.weight": torch.randn(shared * inter, hidden, generator=g),
            "mlp.shared_experts.up_proj.weight": torch.randn(shared * inter, hidden, generator=g),
            "mlp.shared_experts.down_proj.weight": torch.randn(hidden, shared * inter, generator=g)}


def _shared_mlp(ckpt, x):  # the separate shared MLP: down(silu(gate x) * up x)
    gate, up = x @ ckpt["mlp.shared_experts.gate_proj.weight"].t(), x @ ckpt["mlp.shared_experts.up_proj.weight"].t()
    return (torch.nn.functional.silu(gate) * up) @ ckpt["mlp.shared_experts.down_proj.weight"].t()


@pytest.mark.parametrize("shared", [1, 2])
@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("tokens", [5, FUSED_SHARED_MAX_TOKENS + 7])  # routed with the experts; dense
def test_fused_shared_experts_equal_routed_plus_shared_mlp(shared, tp_size, tokens):
    """Shared experts stored as experts E.. E+S-1 (intermediate split by index, each TP rank its slice of
    each) give the routed experts plus the separate shared MLP, through the grouped experts (small steps)
    or as dense GEMMs over the same slots (large steps); ranks' partial outputs sum to it."""
    experts, hidden, inter = 4, 16, 8
    routing = RoutingConfig(num_experts=experts, top_k=2, renormalize=True, routed_scaling_factor=2.5)
    fused_routing = RoutingConfig(**{**routing.__dict__, "num_fused_shared_experts": shared})
    ckpt = {**_per_expert_checkpoint(), **_shared_checkpoint(shared)}
    mapping = FusedMoE.make_expert_params_mapping(experts) + FusedMoE.make_shared_expert_params_mapping()
    x = torch.randn(tokens, hidden)
    logits = torch.randn(tokens, experts)
    plain = _Block(FusedMoE(experts, hidden, inter, routing, prefix="mlp.experts"))
    load_mapped_weights(plain, _per_expert_checkpoint().items(), FusedMoE.make_expert_params_mapping(experts))
    want = plain.mlp.experts(x, logits) + _shared_mlp(ckpt, x)
    total = torch.zeros_like(want)
    for rank in range(tp_size):
        layer = FusedMoE(experts, hidden, inter, fused_routing, prefix="mlp.experts",
                         parallel=FusedMoEParallelConfig(tp_size=tp_size, tp_rank=rank))
        assert layer.w13_weight.shape == (experts + shared, 2 * inter // tp_size, hidden)
        block = _Block(layer)
        loaded = load_mapped_weights(block, ckpt.items(), mapping)
        assert loaded == {"mlp.experts.w13_weight", "mlp.experts.w2_weight"}  # shared shards counted
        total += layer(x, logits)
    torch.testing.assert_close(total, want, atol=1e-4, rtol=1e-4)


def test_fused_shared_experts_loading_is_strict():
    fused = RoutingConfig(num_experts=4, top_k=2, num_fused_shared_experts=2)
    mapping = FusedMoE.make_expert_params_mapping(4) + FusedMoE.make_shared_expert_params_mapping()
    block = _Block(FusedMoE(4, 16, 8, fused, prefix="mlp.experts"))
    loaded = load_mapped_weights(block, _per_expert_checkpoint().items(), mapping)
    assert loaded == set()  # the shared shards never arrived
    bad = {**_shared_checkpoint(1)}  # one shared expert's intermediate for a layer of two
    with pytest.raises(WeightLoadError, match="shared experts"):
        load_mapped_weights(block, bad.items(), mapping)
    with pytest.raises(ValueError, match="fused shared experts need unquantized"):
        FusedMoE(4, 16, 8, fused, parallel=FusedMoEParallelConfig(ep_size=2, ep_rank=0))
