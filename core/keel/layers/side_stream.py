"""Work beside the main stream inside a captured CUDA graph: a MoE block's shared experts next to its routed ones.

A decode step's MoE is bound by reading expert weights while its shared experts are a few small dense GEMMs:
run one after the other, the GEMMs' fixed costs and their SM-filling tails add up; launched on a second
stream, they fill SMs the memory-bound grouped GEMM leaves waiting. SGLang runs DeepSeek's shared experts this
way. Only while a CUDA graph is being captured: the graph records the fork and the join as edges, so replays pay
nothing for the second stream and the allocator's ordering is the graph's (memory a side-stream op frees is
reused only after the next fork, which follows the join). Eager steps (prefill, compute-bound) run in order.

    side = fork(x)              # None: run everything on the current stream
    with on(side):
        shared = shared_mlp(x)  # reads only what existed before the fork
    out = routed(x)
    join(side)                  # the current stream waits for the side stream
"""

from __future__ import annotations

import contextlib

import torch

_STREAMS: dict[int, torch.cuda.Stream] = {}


def fork(t: torch.Tensor) -> torch.cuda.Stream | None:
    """A side stream that has waited for the current one, when `t` is on a CUDA device whose current stream
    is capturing a graph; otherwise None. Called by a layer's forward before the work it moves aside."""
    if not t.is_cuda or not torch.cuda.is_current_stream_capturing():
        return None
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    side = _STREAMS.get(index)
    if side is None:
        side = _STREAMS[index] = torch.cuda.Stream(device=index)
    side.wait_stream(torch.cuda.current_stream(index))
    return side


def on(side: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """The context that runs ops on `side` (no-op for None)."""
    return torch.cuda.stream(side) if side is not None else contextlib.nullcontext()


def join(side: torch.cuda.Stream | None) -> None:
    """Makes the current stream wait for everything queued on `side` (no-op for None); every fork must be
    joined before the capture ends."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)
