"""FP8 routed experts, dequantized once at load: the fused-MoE path has no FP8 kernel yet.

DeepSeek-V3's released checkpoint stores its routed experts in block FP8 like every other linear layer.
Until the fused-MoE kernels read FP8 experts (a later step of the quantization work), `Fp8Config`
rewrites the checkpoint stream: each expert's `weight` and its scale become one dequantized tensor,
so the experts run in the model dtype. This is declared with a warning at load, never silent; the
dense, attention and shared-expert layers stay FP8.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch

from keel.models.weights import WeightLoadError
from keel_quantization import fp8_math
from keel_quantization.fp8_linear import Fp8Scheme

logger = logging.getLogger("keel.quantization.fp8")

_EXPERT = re.compile(r"^(?P<base>.+\.experts\.\d+\.[^.]+\.)(?P<kind>weight|weight_scale_inv|weight_scale|input_scale)$")


def dequantize_experts(weights: Iterable[tuple[str, torch.Tensor]], scheme: Fp8Scheme, method: str
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with every routed expert's fp8 weight + scale replaced by a float32 weight.
    A static `input_scale` of an expert is consumed (the dequantized expert runs unquantized)."""
    need = {"weight", scheme.scale_name} | ({"input_scale"} if scheme.activation == "static" else set())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    count = 0
    for name, tensor in weights:
        m = _EXPERT.match(name)
        if m is None or m["kind"] not in need:
            yield name, tensor
            continue
        parts = pending.setdefault(m["base"], {})
        parts[m["kind"]] = getattr(tensor, "materialize", lambda t=tensor: t)()  # lazy loader tensors: read
        if need <= parts.keys():
            del pending[m["base"]]
            w = parts["weight"]
            if w.dtype != fp8_math.FP8:
                raise WeightLoadError(f"{m['base']}weight: expected an fp8 expert weight, got {w.dtype}")
            yield m["base"] + "weight", fp8_math.dequantize(w, parts[scheme.scale_name], scheme.block, torch.float32)
            count += 1
    if pending:
        missing = sorted(f"{base}{kind}" for base, parts in pending.items() for kind in need - parts.keys())
        raise WeightLoadError(f"{method}: routed-expert tensors without their counterparts: {missing}",
                              missing=missing)
    if count:
        logger.warning("%s: %d routed-expert weights dequantized at load (the fused-MoE path has no FP8 "
                       "kernel yet); the experts run in the model dtype", method, count)
