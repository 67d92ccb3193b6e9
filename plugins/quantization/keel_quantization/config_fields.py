"""Reading a checkpoint's `quantization_config`: every field is either used, known to be irrelevant to
inference (listed by each method), or an error naming it -- never silently ignored."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from keel.quantization import QuantizationError


def check_fields(method: str, raw: Mapping[str, Any], used: Iterable[str], inert: Iterable[str] = ()) -> None:
    """Raise naming the fields of `raw` that are neither `used` nor `inert` (calibration metadata)."""
    unknown = sorted(set(raw) - set(used) - set(inert) - {"quant_method"})
    if unknown:
        raise QuantizationError(
            f"quantization_config of method {method!r} has fields keel does not act on: {unknown}; "
            "refusing to load it with them ignored"
        )


def float_dtype_reasons(dtype: Any) -> list[str]:
    """The methods here compute in float32, bfloat16 or float16 activations."""
    import torch

    supported = (torch.float32, torch.bfloat16, torch.float16)
    return [] if dtype in supported else [f"activations in {dtype} are not supported (use one of {supported})"]


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    # A plain name matches whole dotted components ("lm_head", "self_attn", "model.layers.0.mlp.gate"),
    # as transformers matches modules_to_not_convert.
    return f".{pattern}." in f".{name}."


def is_layer_skipped(method: str, prefix: str, ignored: Iterable[str], packed: Mapping[str, list[str]]) -> bool:
    """Whether the layer at `prefix` stays unquantized; a fused layer whose checkpoint modules disagree
    (q_proj ignored, k_proj not) is an error, since its one weight cannot be both."""
    ignored = list(ignored)
    if not ignored:
        return False
    parent, _, leaf = prefix.rpartition(".")
    parts = [f"{parent}.{m}" if parent else m for m in packed.get(leaf, [leaf])]
    skipped = [any(_matches(p, pat) for pat in ignored) for p in parts]
    if any(skipped) and not all(skipped):
        raise QuantizationError(
            f"{method}: fused layer {prefix} packs {parts}, of which only some are left unquantized "
            f"({[p for p, s in zip(parts, skipped) if s]}); keel cannot serve a partly quantized fused layer"
        )
    return all(skipped)


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def experts_skipped(method: str, spec: Any, ignored: Iterable[str], packed: Mapping[str, list[str]]) -> bool:
    """Whether a FusedMoE layer's experts (checkpoint modules f"{prefix}.{e}.gate_proj", ...) stay
    unquantized; some listed and some not is an error (one stacked weight cannot be both)."""
    leaf = spec.prefix.rpartition(".")[2]
    parts = [f"{leaf}.{e}.{p}" for e in range(spec.num_experts) for p in EXPERT_PROJECTIONS]
    return is_layer_skipped(method, spec.prefix, ignored, {**packed, leaf: parts})
