"""FusedMoE: expert weight loading, backend selection, and the Triton kernel against the torch reference.

The Triton kernel runs interpreted on the CPU (TRITON_INTERPRET=1); sizes stay tiny because every
program instance is executed in Python.
"""

from __future__ import annotations

import pytest
import torch

from keel.layers.fused_moe import (
    FusedMoE,
    RoutingConfig,
    fused_experts_torch,
    fused_experts_triton,
    moe_align_block_size,
    triton_available,
)
from keel.layers.fused_moe import layer as moe_layer
from keel.models.weights import WeightLoadError, load_mapped_weights

pytest.importorskip("triton")


# Interpreted kernels on CPU tensors are the CPU machine's check; a GPU machine runs the compiled kernels
# (test_moe_triton_tiles_gpu.py, test_moe_routing_align_gpu.py), and its Triton's interpreter may differ.
interpreted_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted Triton on CPU tensors; the "
                                      "CUDA tests cover the compiled kernels")


@pytest.fixture
def interpret(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("interpreted Triton on CPU tensors; the CUDA tests cover the compiled kernels")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _random_moe(gen, tokens, hidden, inter, experts, top_k, dtype=torch.float32):
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    w = torch.rand(tokens, top_k, generator=gen)
    return x, w13, w2, w


def test_align_block_size_groups_rows_by_expert():
    ids = torch.tensor([[3, 0], [0, 5], [3, 5], [0, 3]])
    sorted_ids, expert_ids, total = moe_align_block_size(ids, num_experts=8, block_m=4)
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


@pytest.mark.parametrize("tokens,top_k,experts", [(7, 2, 8), (1, 1, 4), (19, 3, 6)])
def test_triton_matches_torch_reference(interpret, tokens, top_k, experts):
    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    x, w13, w2, w = _random_moe(gen, tokens, 24, 20, experts, top_k)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ref = fused_experts_torch(x, w13, w2, w, ids)
    out = fused_experts_triton(x, w13, w2, w, ids)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_triton_with_idle_experts_and_all_tokens_on_one_expert(interpret):
    gen = torch.Generator().manual_seed(3)
    x, w13, w2, w = _random_moe(gen, 18, 16, 12, 8, 2)
    ids = torch.tensor([[6, 2]] * 18)  # six experts receive nothing; 18 rows span two blocks each
    torch.testing.assert_close(
        fused_experts_triton(x, w13, w2, w, ids), fused_experts_torch(x, w13, w2, w, ids), atol=1e-5, rtol=1e-5
    )
    assert torch.equal(fused_experts_triton(x[:0], w13, w2, w[:0], ids[:0]), x[:0])


def test_triton_bf16(interpret):
    gen = torch.Generator().manual_seed(5)
    x, w13, w2, w = _random_moe(gen, 9, 32, 16, 4, 2, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(9)])
    ref = fused_experts_torch(x.float(), w13.float(), w2.float(), w, ids)
    torch.testing.assert_close(fused_experts_triton(x, w13, w2, w, ids).float(), ref, atol=5e-2, rtol=5e-2)


def _layer(backend="auto", experts=4, hidden=16, inter=8):
    routing = RoutingConfig(num_experts=experts, top_k=2, renormalize=True)
    return FusedMoE(experts, hidden, inter, routing, backend=backend, prefix="mlp.experts")


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


@interpreted_only
def test_backend_selection(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_available(torch.device("cpu"))
    layer = _layer()
    load_mapped_weights(_Block(layer), _per_expert_checkpoint().items(), FusedMoE.make_expert_params_mapping(4))
    x, logits = torch.randn(5, 16), torch.randn(5, 4)
    ref = layer(x, logits)
    assert layer.last_backend == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_available(torch.device("cpu"))
    torch.testing.assert_close(layer(x, logits), ref, atol=1e-4, rtol=1e-5)
    assert layer.last_backend == "triton"
    forced = _layer(backend="torch")
    forced.load_state_dict(layer.state_dict())
    torch.testing.assert_close(forced(x, logits), ref)
    assert forced.last_backend == "torch"
    with pytest.raises(ValueError, match="MoE backend"):
        _layer(backend="cuda")
    assert moe_layer.MOE_BACKENDS == ("auto", "torch", "triton")
