"""StagingBuffer packs a step's host arrays into one buffer and hands out typed device views.

The packing (16-byte aligned slices, dtype views, growth, slot rotation) is checked here with the "meta"
device, which needs no accelerator: no pinned memory and no events there, so the fallbacks run too. The
pinned, event-guarded copy itself runs on the GPU (tests/test_async_scheduling.py on a CUDA machine).
"""

from __future__ import annotations

import numpy as np
import pytest
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



def test_host_to_device_returns_host_tensors_as_they_are_and_copies_elsewhere():
    from keel.worker.staging import host_to_device

    t = torch.arange(5, dtype=torch.int32)
    assert host_to_device(t, "cpu") is t
    out = host_to_device(t, torch.device("meta"))  # no pinned memory there: the plain-memory fallback
    assert out.device.type == "meta" and out.shape == t.shape and out.dtype == t.dtype


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned copy needs a CUDA device")
def test_host_to_device_copies_through_pinned_memory_without_waiting_for_the_stream():
    from keel.worker.staging import host_to_device

    import time

    t = torch.arange(1000, dtype=torch.int64)
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(100_000_000)  # the stream is busy: a pageable copy may wait for it, this one must not
    out = host_to_device(t, "cuda")
    returned = time.perf_counter() - start
    t.fill_(-1)  # the source may change at once: the copy reads its own pinned buffer
    torch.cuda.synchronize()
    busy = time.perf_counter() - start
    assert returned < 0.5 * busy, (returned, busy)
    assert out.device.type == "cuda" and torch.equal(out.cpu(), torch.arange(1000))
