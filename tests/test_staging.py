"""StagingBuffer packs a step's host arrays into one buffer and hands out typed device views.

The packing (16-byte aligned slices, dtype views, growth, slot rotation) is checked here with the "meta"
device, which needs no accelerator: no pinned memory and no events there, so the fallbacks run too. The
pinned, event-guarded copy itself runs on the GPU (tests/test_async_scheduling.py on a CUDA machine).
"""

from __future__ import annotations

import numpy as np
import torch

from keel.worker.staging import StagingBuffer


def _arrays(rng, n):
    return {
        "ids": rng.integers(0, 1000, size=n).astype(np.int64),
        "qsl": np.arange(n + 1, dtype=np.int32),
        "table": rng.integers(0, 50, size=(n, 3)).astype(np.int32),
        "temp": rng.random(n).astype(np.float32),
        "flags": rng.random(n) > 0.5,
        "empty": np.zeros(0, dtype=np.int64),
    }


def test_meta_device_views_have_every_array_shape_and_dtype():
    rng = np.random.default_rng(0)
    buf = StagingBuffer(torch.device("meta"))
    for n in (3, 1, 17, 5):  # growth and slot rotation
        arrays = _arrays(rng, n)
        out = buf.stage(arrays)
        assert out.keys() == arrays.keys()
        for name, a in arrays.items():
            t = out[name]
            assert t.device.type == "meta" and tuple(t.shape) == a.shape, name
            assert t.dtype == torch.from_numpy(a).dtype, name
            # 16-byte aligned whatever the sizes before: Triton compiles a kernel variant per pointer
            # alignment class, so an offset that followed the batch would compile while serving
            assert t.storage_offset() * t.element_size() % 16 == 0, name
    assert buf.num_copies == 4


def test_host_device_wraps_arrays_without_copies():
    rng = np.random.default_rng(1)
    arrays = _arrays(rng, 6)
    out = StagingBuffer(torch.device("cpu")).stage(arrays)
    for name, a in arrays.items():
        assert np.array_equal(out[name].numpy(), a)


def test_packed_copy_round_trips_every_value():
    """The device path run with a CPU "device" (the packing step forced on): values, dtypes and shapes
    come back exactly, across growth and both slots."""
    rng = np.random.default_rng(2)
    buf = StagingBuffer(torch.device("cpu"))
    buf.is_host = False
    for n in (4, 9, 2, 33, 7):
        arrays = _arrays(rng, n)
        out = buf.stage(arrays)
        for name, a in arrays.items():
            assert out[name].dtype == torch.from_numpy(a).dtype
            assert np.array_equal(out[name].numpy(), a), name

