"""Activation quantization fused into the layer that produces a quantized linear layer's input.

A linear layer whose method quantizes its activations (fp8 W8A8: per token, per group or static) reads them in the model
dtype and quantizes them in a launch of its own. Where the model declares which module produces that input
unchanged (`LinearBase.set_input_producer`: the RMSNorm before qkv and gate_up, the SiluAndMul before down),
the producer can write the quantized activations itself: one launch and one round trip of the activations
through memory fewer, the same numbers (the producer rounds to the model dtype first, exactly where the
unfused pair rounds).

Lifecycle: after loading (and after `process_weights_after_loading`), the loader calls `bind_input_quant`. For
each declared producer it asks every consumer's method for `input_quant_fusion(module) -> InputQuantFusion |
None` (an optional member of a `QuantizationMethod`; None: this layer takes model-dtype inputs only). A producer
may feed several layers (DeepSeek's first norm: q_a and kv_a), which then share one quantized input: their
fusions must `merge` into one that serves them all (else the producer stays unfused). If the fusion `supports`
the producer's op and shape, the producer keeps it in `fused_input_quant` and, in every forward of more than
`min_m` tokens, returns a `QuantizedInput` from the fusion's kernel instead of a tensor; the consumers' `apply`
take it. Steps of at most `min_m` tokens (the consumer's small-M path quantizes in its own
prologue) keep the model-dtype tensor. Token counts are static per CUDA graph, so the choice is too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

logger = logging.getLogger("keel.input_quant")

# The producer ops a fusion may implement (a producer layer names its own in `input_quant_op`), with their
# contracts; out is a QuantizedInput of what the layer's own math returns, rounded to the model dtype first:
#   rms_norm(x, residual, weight, eps) -> (out, new_residual)   residual None: new_residual None (RMSNorm)
#   silu_and_mul(x) -> out                                      x [M, 2 * d] (SiluAndMul)
PRODUCER_OPS = ("rms_norm", "silu_and_mul")


@dataclass(frozen=True)
class QuantizedInput:
    """A linear layer's input, already quantized by its producer: `values` [M', K] (e.g. e4m3) and `scales`
    [M', groups] float32, in the layout the consumer's method asked for (M' >= num_tokens where it pads rows);
    `dtype` is the model dtype the unquantized activations had (the layer's output dtype)."""

    values: torch.Tensor  # [M', K]
    scales: torch.Tensor  # [M', groups] float32, any strides
    dtype: torch.dtype
    num_tokens: int  # the real rows (M)


@runtime_checkable
class InputQuantFusion(Protocol):
    """Returned by a quantization method's `input_quant_fusion(module)`; held by the producer layer."""

    min_m: int  # steps of at most this many tokens keep the unfused input (the consumer's small-M path)

    def supports(self, op: str, width: int) -> bool:
        """Called by `bind_input_quant` once per declared pair: can the fusion produce `op` (one of PRODUCER_OPS)
        for rows of `width` outputs? False leaves the pair unfused (logged)."""
        ...

    def __call__(self, op: str, *args: Any) -> Any:
        """Called by the producer's forward (also inside captured CUDA graphs): op's contract above."""
        ...

    def merge(self, other: InputQuantFusion) -> InputQuantFusion | None:
        """Called by `bind_input_quant` when a producer feeds several layers: one fusion whose output every layer
        of both takes (min_m the larger), or None when no layout serves both. Optional: without it, only equal
        fusions merge."""
        ...


def bind_input_quant(model: nn.Module) -> int:
    """Called by the loader once every layer's method has processed its weights: binds each declared producer to
    its consumers' fusion (see the module docstring). Returns how many producers were bound."""
    from keel.layers.linear import LinearBase

    consumers: dict[int, tuple[nn.Module, list[LinearBase]]] = {}  # id(producer) -> (producer, its consumers)
    for module in model.modules():
        if isinstance(module, LinearBase) and module.input_producer is not None:
            producer = module.input_producer[0]
            consumers.setdefault(id(producer), (producer, []))[1].append(module)
    bound, declined = 0, []
    for producer, layers in consumers.values():
        fusions = [_offered(layer) for layer in layers]
        if all(f is None for f in fusions):
            continue
        fusion = None if any(f is None for f in fusions) else _merged(fusions)
        op = getattr(producer, "input_quant_op", None)
        widths = {layer.input_size_per_partition for layer in layers}
        if fusion is None or op is None or len(widths) != 1 or not fusion.supports(op, widths.pop()):
            declined.append(f"{' + '.join(layer.prefix for layer in layers)} ({type(producer).__name__})")
            continue
        producer.fused_input_quant = fusion
        bound += 1
    if declined:
        logger.info("activation quantization not fused into the producer of %s%s", ", ".join(declined[:3]),
                    f" and {len(declined) - 3} more" if len(declined) > 3 else "")
    if bound:
        logger.info("activation quantization fused into %d producer layer(s)", bound)
    return bound


def _offered(layer: nn.Module) -> Any:
    make = getattr(layer.quant_method, "input_quant_fusion", None)
    return make(layer) if make is not None else None


def _merged(fusions: list[Any]) -> Any:
    """One fusion serving every consumer of a producer, or None."""
    fusion = fusions[0]
    for other in fusions[1:]:
        merge = getattr(fusion, "merge", None)
        fusion = merge(other) if merge is not None else (fusion if fusion == other else None)
        if fusion is None:
            return None
    return fusion
