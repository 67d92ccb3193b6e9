"""The tensor ops a decode step issues from the host outside the forward: on a GPU each is host time
(~5 us), so a step repeating the layout of the step before re-slices nothing. Counted with a
TorchDispatchMode on CPU tensors standing in for the device (the packing and staging code is the same)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from keel.attention.metadata import CommonAttentionMetadata
from keel.worker.cuda_graph import DecodeGraphRunner
from keel.worker.staging import StagingBuffer


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def _step_arrays(rng, n: int) -> dict[str, np.ndarray]:
    return {"input_ids": rng.integers(0, 100, n).astype(np.int64), "qsl": np.arange(n + 1, dtype=np.int32),
            "table": rng.integers(0, 9, (n, 16)).astype(np.int32), "temperature": rng.random(n).astype(np.float32)}


def test_staging_a_repeated_layout_issues_one_copy_and_keeps_its_views():
    rng = np.random.default_rng(0)
    buf = StagingBuffer(torch.device("cpu"))
    buf.is_host = False  # the device path: one packed copy and typed views of the device buffer
    first = buf.stage(_step_arrays(rng, 6))
    arrays = _step_arrays(rng, 6)
    with OpCount() as count:
        second = buf.stage(arrays)
    assert all(second[name] is first[name] for name in arrays)
    # the copy and its two slices; no view per array
    assert count.ops["aten.copy_.default"] == 1 and count.ops["aten.slice.Tensor"] == 2, count.ops
    assert not any(op.startswith("aten.view") for op in count.ops), count.ops
    for name, a in arrays.items():
        assert np.array_equal(second[name].numpy(), a), name
    other = _step_arrays(rng, 3)  # another batch size: new views, right values
    third = buf.stage(other)
    for name, a in other.items():
        assert tuple(third[name].shape) == a.shape and np.array_equal(third[name].numpy(), a), name


class _Graphs(DecodeGraphRunner):
    """Replays nothing: the static buffers as staged are the output."""

    def capture(self) -> None:
        for q, b in self.keys:
            self.graphs[(q, b)] = (None, None)

    def _replay(self, key):
        return self.input_ids[: key[0] * key[1]]


def _common(n: int, seq_lens: list[int], slots: list[int], table: torch.Tensor) -> CommonAttentionMetadata:
    qsl = torch.arange(n + 1, dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, seq_lens_cpu=seq,
                                   block_table=table, slot_mapping=torch.tensor(slots, dtype=torch.int64), num_reqs=n,
                                   num_actual_tokens=n, max_query_len=1, max_seq_len=max(seq_lens), block_size=16)


def test_graph_staging_pads_and_slices_the_static_buffers_once_per_shape():
    g = _Graphs(torch.nn.Identity(), [], [], [], torch.device("cpu"), 16, [4], 64)
    g.capture()
    table = torch.tensor([[1, 2, 0, 0] + [0] * 12, [3, 0, 0, 0] + [0] * 12, [5, 6, 7, 0] + [0] * 12],
                         dtype=torch.int32)
    g.slot_mapping.fill_(7)  # stale values: the padding request must get -1 again
    g.run(torch.tensor([11, 12, 13]), torch.tensor([20, 5, 40]), _common(3, [21, 6, 41], [36, 53, 104], table))
    step = torch.tensor([14, 15, 16]), torch.tensor([21, 6, 41]), _common(3, [22, 7, 42], [37, 54, 105], table)
    with OpCount() as count:
        out = g.run(*step)
    assert out.tolist() == [14, 15, 16]
    assert g.positions[:3].tolist() == [21, 6, 41] and g.seq_lens.tolist() == [22, 7, 42, 0]
    assert g.slot_mapping[:4].tolist() == [37, 54, 105, -1] and torch.equal(g.block_table[:3, :16], table)
    # five copies, the padding's zero and fill, the output's slice (and this stub replay's): no other slicing
    assert count.ops["aten.copy_.default"] == 5 and count.ops["aten.slice.Tensor"] <= 2, count.ops
    assert count.total <= 10, count.ops  # with the query starts read on the host (graph_key)
