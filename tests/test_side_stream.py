"""keel.layers.side_stream: outside a CUDA graph capture (and on the CPU) nothing forks, so eager steps run their
ops in order on the current stream; inside a capture, work moved aside must equal the in-order result (the CUDA
half runs on a GPU: the fused MoE's dense shared experts in plugins/kernels_triton/tests/test_moe_fused_shared.py,
replayed against the eager forward bit for bit)."""

from __future__ import annotations

import pytest
import torch

from keel.layers import side_stream


def test_nothing_forks_on_the_cpu():
    x = torch.ones(4)
    side = side_stream.fork(x)
    assert side is None
    with side_stream.on(side):
        y = x * 2
    side_stream.join(side)
    assert torch.equal(y, torch.full((4,), 2.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_capture_forks_and_joins_and_eager_does_not():
    x = torch.randn(64, 64, device="cuda")
    assert side_stream.fork(x) is None  # eager: in order

    def step():
        side = side_stream.fork(x)
        assert side is not None and side != torch.cuda.current_stream()
        with side_stream.on(side):
            aside = x @ x
        main = x + 1
        side_stream.join(side)
        return main + aside

    _ = x @ x  # cuBLAS set up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn(64, 64, device="cuda"))
    graph.replay()
    torch.testing.assert_close(out, (x + 1) + x @ x)
