"""StagingBuffer: a step's host inputs reach the device in one copy from pinned memory.

A step needs a dozen small host arrays on the device (token ids, positions, query starts, sequence
lengths, block table, slot mapping, sampling rows and parameters). One `cudaMemcpyAsync` each costs
host time per call, and a copy from pageable memory may wait for the stream to drain -- which would
undo async scheduling, where the host prepares step N+1 while the device still runs step N. So the
model runner packs all of them into one pinned byte buffer (16-byte aligned slices), issues one
non-blocking copy into a device byte buffer, and hands out typed views of it.

Hazards, and why they are safe: the device buffer is rewritten by the next step's copy, which is
ordered on the same stream after every kernel of this step that reads it. The pinned buffers are
rotated (two slots) and a slot is only rewritten after the event recorded behind its last copy
fired. On a CPU device there is nothing to copy: the arrays are wrapped as tensors in place.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger("keel.worker")
# Every slice starts 16-byte aligned, whatever the sizes before it: Triton specializes a kernel on
# whether each pointer argument is 16-byte aligned, so an offset that depended on the batch size would
# compile a new kernel variant in the middle of serving (measured on an H200: 10 extra MLA-attention
# compiles, ~9 s, in the first big batch after start).
_ALIGN = 16
_PINNED_OK: dict[str, bool] = {}  # device type -> whether pinned host memory could be allocated


def pinned_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor in pinned memory for copies to/from `device`; plain host memory (logged once) where
    the device's backend cannot pin, so a platform without it still works (its copies block)."""
    kind = device.type
    if _PINNED_OK.get(kind, True):
        try:
            out = torch.empty(shape, dtype=dtype, pin_memory=True)
            _PINNED_OK[kind] = True
            return out
        except RuntimeError as exc:
            _PINNED_OK[kind] = False
            logger.warning("no pinned host memory for device %s (%s): host copies will block", kind, exc)
    return torch.empty(shape, dtype=dtype)


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` (a host tensor) on `device`, copied without making the host wait for the device.

    For per-step tensors built outside the runner's `StagingBuffer` (a backend's tile tables, the
    sampler's penalty rows). A copy from pageable memory may first synchronize with the stream -- under
    async scheduling, wait for the step in flight, so everything the host does after it in this step
    is no longer hidden. The copy goes through a fresh pinned tensor instead; PyTorch's caching host
    allocator keeps it until the copy has run. On a CPU device `t` itself is returned.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return t
    pinned = pinned_empty(t.shape, t.dtype, device).copy_(t)
    return pinned.to(device, non_blocking=True)


def record_event(device: torch.device) -> torch.Event | None:
    """An event recorded on `device`'s current stream, or None where the backend has none (then the
    caller's copies were synchronous)."""
    try:
        event = torch.Event(device=device)
        event.record()
        return event
    except (RuntimeError, ValueError, TypeError):
        return None


class StagingBuffer:
    """Owned by the model runner; `stage` once per step (and only from the runner's thread)."""

    def __init__(self, device: torch.device, num_slots: int = 2) -> None:
        self.device = torch.device(device)
        self.is_host = self.device.type == "cpu"
        self._hosts: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8) for _ in range(num_slots)]
        self._events: list[torch.Event | None] = [None] * num_slots
        self._device_buf = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._slot = 0
        self.num_copies = 0  # host-to-device copies issued (one per non-empty `stage` call)
        # The typed views of the last layout ((name, dtype, shape) per array): a decode step usually
        # stages the same shapes as the step before, and three tensor ops per array and step are host
        # time on an accelerator (~5 us each); the device buffer being the same, the views are too.
        self._views_key: tuple | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._views_dev: torch.Tensor | None = None

    def stage(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Device tensors with the arrays' dtypes, shapes and values, moved in one copy.

        The returned tensors are views valid until the next `stage` call's copy runs on the stream
        (every kernel enqueued before that call may read them).
        """
        arrays = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
        if self.is_host:
            return {name: torch.from_numpy(a) for name, a in arrays.items()}
        offsets, total = {}, 0
        for name, a in arrays.items():
            offsets[name] = total
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        if total == 0:
            return {name: torch.from_numpy(a).to(self.device) for name, a in arrays.items()}
        slot = self._slot
        self._slot = (slot + 1) % len(self._hosts)
        if self._events[slot] is not None:
            self._events[slot].synchronize()  # the copy that last read this pinned slot is done
        if self._hosts[slot].numel() < total:
            self._hosts[slot] = pinned_empty((max(total, 2 * self._hosts[slot].numel()),), torch.uint8, self.device)
        if self._device_buf.numel() < total:
            self._device_buf = torch.empty(max(total, 2 * self._device_buf.numel()), dtype=torch.uint8,
                                           device=self.device)
        host = self._hosts[slot]
        host_np = host.numpy()
        for name, a in arrays.items():
            off = offsets[name]
            host_np[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)
        dev = self._device_buf
        dev[:total].copy_(host[:total], non_blocking=True)
        self._events[slot] = record_event(self.device)
        self.num_copies += 1
        key = tuple((name, a.dtype, a.shape) for name, a in arrays.items())
        if key != self._views_key or self._views_dev is not dev:
            self._views = {name: dev[offsets[name] : offsets[name] + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
                           for name, a in arrays.items()}
            self._views_key, self._views_dev = key, dev
        return dict(self._views)


_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.bool_): torch.bool,
}
