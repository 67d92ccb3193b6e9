"""Conformance for a quantization method's activation-quantization fusion (`keel.layers.input_quant`), for third
parties to run against their own method:

    check_input_quant_fusion(producer, consumer, make_input, ms=(1, 4, 5, 64))

`producer` is the module whose output the `consumer` linear layer takes (an RMSNorm or a SiluAndMul, any bound ops
already in place), `consumer` a loaded layer whose method offers `input_quant_fusion`, `make_input(m)` the
producer's arguments for a step of m tokens (fresh each call, the same for the same m). It checks that:
- the pair binds (the method offers a fusion and it supports the producer's op and width);
- steps of at most `min_m` tokens keep the model-dtype tensor, steps past it hand the layer a `QuantizedInput`;
- every step's output (and an RMSNorm's new residual) equals the unbound pair's: bit for bit by default (keel's
  fp8 fusion is), or within `atol` where the method says so -- a request's result should not depend on its step.
The pair is left unbound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from keel.layers.input_quant import QuantizedInput, bind_input_quant


class _Pair(nn.Module):
    def __init__(self, producer: nn.Module, consumer: nn.Module) -> None:
        super().__init__()
        self.producer, self.consumer = producer, consumer

    def forward(self, *args: Any) -> tuple[torch.Tensor, Any]:
        out = self.producer(*args)
        x, rest = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
        return self.consumer(x), rest


def check_input_quant_fusion(producer: nn.Module, consumer: nn.Module, make_input: Callable[[int], Sequence[Any]],
                             ms: Sequence[int] = (1, 4, 5, 64), atol: float = 0.0) -> dict[str, Any]:
    """Raises AssertionError naming what does not hold; returns {"min_m": ..., "fused_ms": [...]}."""
    consumer.set_input_producer(producer)
    pair = _Pair(producer, consumer)
    with torch.no_grad():
        want = {m: pair(*make_input(m)) for m in ms}
        assert bind_input_quant(pair) == 1, (
            f"{type(consumer.quant_method).__name__} offers no activation fusion for a {type(producer).__name__} "
            f"producing {consumer.input_size_per_partition} inputs (input_quant_fusion returned None, or its "
            "supports() said no)")
        fusion = producer.fused_input_quant
        method = consumer.quant_method
        seen: list[tuple[int, type]] = []
        apply = method.apply

        def spy(module: nn.Module, x: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
            seen.append((x.shape[0] if not isinstance(x, QuantizedInput) else x.num_tokens, type(x)))
            return apply(module, x, bias)

        method.apply = spy
        try:
            for m in ms:
                got, rest = pair(*make_input(m))
                want_out, want_rest = want[m]
                _same(got, want_out, atol, f"the layer's output at {m} tokens")
                if want_rest is not None:
                    _same(rest, want_rest, 0.0, f"the producer's second output (the new residual) at {m} tokens")
        finally:
            del method.apply
            producer.fused_input_quant = None
    for m, kind in seen:
        fused = m > fusion.min_m
        assert (kind is QuantizedInput) == fused, (
            f"a step of {m} tokens handed the layer a {kind.__name__}; expected "
            f"{'a QuantizedInput (past' if fused else 'the model-dtype tensor (at most'} min_m = {fusion.min_m})")
    return {"min_m": fusion.min_m, "fused_ms": [m for m in ms if m > fusion.min_m]}


def _same(got: torch.Tensor, want: torch.Tensor, atol: float, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: {tuple(got.shape)} {got.dtype}, unfused {tuple(want.shape)} {want.dtype}")
    if atol == 0.0:
        assert torch.equal(got, want), f"{what} differs from the unfused pair's (max |diff| " \
                                       f"{(got.float() - want.float()).abs().max().item():.3g}; bit-equal expected)"
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")
