"""LazySafetensor reads only what a weight loader keeps: a rank's narrowed shard, nothing for a tensor
another rank loads; everything else behaves like the tensor it stands for."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from keel.layers.linear import RowParallelLinear
from keel.models.lazy_tensor import LazySafetensor
from keel.models.loader import iterate_safetensors


class RecordingSource:
    """A safetensors slice stand-in that records which parts were read."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.reads = t, []

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def __getitem__(self, key):
        self.reads.append(tuple((k.start, k.stop) for k in key))
        return self.t[key]


def test_a_row_parallel_rank_reads_only_its_columns():
    w = torch.randn(4, 8)
    src = RecordingSource(w)
    layer = RowParallelLinear(8, 4, tp_size=2, tp_rank=1)
    layer.weight.weight_loader(layer.weight, LazySafetensor.of(src, torch.float32))
    assert torch.equal(layer.weight.data, w[:, 4:])
    assert src.reads == [((0, 4), (4, 8))]


def test_it_behaves_like_the_tensor_it_stands_for():
    w = torch.randn(6, 3)
    lazy = LazySafetensor.of(RecordingSource(w), torch.float32)
    assert lazy.shape == w.shape and lazy.dim() == 2 and lazy.dtype == torch.float32
    assert torch.equal(lazy[2:5].materialize(), w[2:5]) and lazy[2:5].shape == (3, 3)
    assert torch.equal(lazy.narrow(1, 1, 2).materialize(), w[:, 1:3])
    assert torch.equal(torch.cat([lazy, lazy]), torch.cat([w, w]))
    assert torch.equal(lazy * 2, w * 2) and torch.equal(lazy.t(), w.t()) and torch.equal(lazy[1], w[1])


def test_unread_tensors_cost_nothing(tmp_path):
    save_file({"a": torch.ones(3, 2), "b": torch.zeros(5)}, str(tmp_path / "model.safetensors"))
    items = dict((name, t.shape) for name, t in iterate_safetensors(tmp_path, lazy=True))
    assert items == {"a": (3, 2), "b": (5,)}
    eager = dict(iterate_safetensors(tmp_path))
    assert all(isinstance(t, torch.Tensor) for t in eager.values())
