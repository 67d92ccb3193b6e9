"""Tensor-parallel weight loaders: each rank's shard, recombined, equals the unsharded layer.

No process group is needed: ranks are built side by side and their partial results combined here
exactly as the all-gather / all-reduce would.
"""

from __future__ import annotations

import pytest
import torch

from keel.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from keel.layers.vocab_embedding import VocabParallelEmbedding
from keel.models.weights import WeightLoadError, WeightShapeError

TP = 2
g = torch.Generator().manual_seed(0)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def test_column_parallel_split() -> None:
    w, b, x = _randn(12, 8), _randn(12), _randn(3, 8)
    outs = []
    for r in range(TP):
        layer = ColumnParallelLinear(8, 12, bias=True, tp_size=TP, tp_rank=r)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        assert layer.weight.shape == (6, 8)
        outs.append(layer(x))
    torch.testing.assert_close(torch.cat(outs, -1), x @ w.T + b)


def test_merged_column_parallel_split_keeps_gate_and_up_separate() -> None:
    gate, up = _randn(10, 8), _randn(10, 8)
    for r in range(TP):
        layer = MergedColumnParallelLinear(8, [10, 10], tp_size=TP, tp_rank=r)
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        # rank r holds [gate_r; up_r] so the activation stays local
        expected = torch.cat([gate[r * 5 : (r + 1) * 5], up[r * 5 : (r + 1) * 5]])
        torch.testing.assert_close(layer.weight.data, expected)
    with pytest.raises(WeightLoadError, match="shard id"):
        layer.weight.weight_loader(layer.weight, gate, 2)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_qkv_split_and_kv_replication(kv_heads: int) -> None:
    tp, heads, hd, hidden = 4, 8, 2, 6
    q, k, v = _randn(heads * hd, hidden), _randn(kv_heads * hd, hidden), _randn(kv_heads * hd, hidden)
    for r in range(tp):
        layer = QKVParallelLinear(hidden, hd, heads, kv_heads, bias=False, tp_size=tp, tp_rank=r)
        for sid, t in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, t, sid)
        qs, ks, vs = layer.split_qkv(layer.weight.data.T)
        per_q = heads // tp * hd
        torch.testing.assert_close(qs.T, q[r * per_q : (r + 1) * per_q])
        kv_head = r * kv_heads // tp  # the KV head(s) rank r serves
        n_kv = max(1, kv_heads // tp)
        rows = slice(kv_head * hd, (kv_head + n_kv) * hd)
        torch.testing.assert_close(ks.T, k[rows])
        torch.testing.assert_close(vs.T, v[rows])
        assert layer.num_kv_heads == n_kv


def test_qkv_rejects_indivisible_heads() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        QKVParallelLinear(8, 2, 6, 2, tp_size=4)
    with pytest.raises(ValueError, match="multiple of the number of KV heads"):
        QKVParallelLinear(8, 2, 12, 3, tp_size=4)


def test_row_parallel_partial_sums() -> None:
    w, b, x = _randn(5, 12), _randn(5), _randn(3, 12)
    total = torch.zeros(3, 5)
    for r in range(TP):
        layer = RowParallelLinear(12, 5, bias=True, tp_size=TP, tp_rank=r, reduce_results=False)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        assert layer.weight.shape == (5, 6)
        total += layer(x[:, r * 6 : (r + 1) * 6])
    torch.testing.assert_close(total, x @ w.T + b)  # bias counted once (rank 0)


def test_row_parallel_without_process_group_refuses_to_reduce() -> None:
    layer = RowParallelLinear(4, 2, tp_size=TP, tp_rank=0)
    with pytest.raises(RuntimeError, match="tensor-parallel"):
        layer(torch.zeros(1, 2))


def test_vocab_parallel_split_pads_last_rank() -> None:
    w = _randn(7, 3)
    shards = []
    for r in range(TP):
        emb = VocabParallelEmbedding(7, 3, tp_size=TP, tp_rank=r)
        emb.weight.weight_loader(emb.weight, w)
        shards.append(emb.weight.data)
    assert shards[0].shape == shards[1].shape == (4, 3)
    torch.testing.assert_close(torch.cat(shards)[:7], w)
    assert torch.all(shards[1][3] == 0)  # padding row


def test_sharded_loaders_still_check_full_shapes() -> None:
    layer = ColumnParallelLinear(8, 12, bias=False, tp_size=TP, tp_rank=1)
    with pytest.raises(WeightShapeError, match=r"\(10, 8\)"):
        layer.weight.weight_loader(layer.weight, _randn(10, 8))
    row = RowParallelLinear(12, 5, tp_size=TP, tp_rank=1)
    with pytest.raises(WeightShapeError):
        row.weight.weight_loader(row.weight, _randn(5, 10))
    qkv = QKVParallelLinear(8, 2, 4, 2, tp_size=TP, tp_rank=0)
    with pytest.raises(WeightShapeError, match="shard k"):
        qkv.weight.weight_loader(qkv.weight, _randn(6, 8), "k")
