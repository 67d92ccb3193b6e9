"""Quantization method "compressed-tensors": the FP8 (W8A8 and weight-only) schemes of llm-compressor.

Most FP8 checkpoints on the hub use this layout: `config_groups` each name `targets` ("Linear", or
"re:" patterns over module names) and a scheme for `weights` and `input_activations`; `ignore` lists
modules left unquantized. Served: 8-bit float weights with strategy "tensor", "channel" or "block"
(`block_structure`), tensors `weight` (e4m3) and `weight_scale` ([1], [out, 1] or block-shaped);
activations none, dynamic "token", dynamic "group" (block weights) or static "tensor" (`input_scale`).
Any other scheme (int8, 4-bit packed, sparsity, an fp8 KV cache scheme) is an error naming it.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from keel.quantization import LinearLayerSpec, MoELayerSpec, QuantizationError, QuantizationRequest
from keel_quantization.config_fields import EXPERT_PROJECTIONS, check_fields, is_layer_skipped
from keel_quantization.fp8 import fp8_moe_method, validate_fp8
from keel_quantization.fp8_linear import Fp8LinearMethod, Fp8Scheme
from keel_quantization.fp8_moe import Fp8MoEMethod
from keel_quantization.fp8_native import NativeChoiceLog

NAME = "compressed-tensors"
_ARGS = ("num_bits", "type", "symmetric", "strategy", "dynamic", "group_size", "block_structure", "actorder")
_INERT_ARGS = ("observer", "observer_kwargs")


def _args(what: str, args: dict[str, Any]) -> dict[str, Any]:
    check_fields(f"{NAME} {what}", args, _ARGS, _INERT_ARGS)
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise QuantizationError(
            f"{NAME}: {what} with num_bits={args.get('num_bits')!r}, type={args.get('type')!r} are not served "
            "(only 8-bit float)"
        )
    if args.get("symmetric", True) is not True:
        raise QuantizationError(f"{NAME}: asymmetric fp8 {what} are not served")
    if args.get("actorder") is not None:
        raise QuantizationError(f"{NAME}: {what} actorder={args['actorder']!r} is not served for fp8")
    return args


def scheme_from(group: dict[str, Any]) -> Fp8Scheme:
    """The Fp8Scheme of one config group; raises naming the first unsupported setting."""
    check_fields(f"{NAME} config group", group, ("targets", "weights", "input_activations", "output_activations",
                                                 "format"))
    if group.get("output_activations") is not None:
        raise QuantizationError(f"{NAME}: output_activations quantization is not served")
    if group.get("format") not in (None, "float-quantized", "naive-quantized"):
        raise QuantizationError(f"{NAME}: config group format {group['format']!r} is not served")
    w = _args("weights", group.get("weights") or {})
    if w.get("dynamic"):
        raise QuantizationError(f"{NAME}: dynamic weight quantization is not served")
    strategy = w.get("strategy")
    block = None
    if strategy == "block":
        bs = w.get("block_structure")
        if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
            raise QuantizationError(f"{NAME}: block weights need block_structure [rows, cols], got {bs!r}")
        block = (bs[0], bs[1])
    elif strategy not in ("tensor", "channel"):
        raise QuantizationError(f"{NAME}: weight strategy {strategy!r} is not served for fp8 (tensor, channel, block)")
    a = group.get("input_activations")
    if a is None:
        activation = "none"
    else:
        a = _args("input_activations", a)
        kind = (bool(a.get("dynamic")), a.get("strategy"))
        if kind == (False, "tensor"):
            activation = "static"
        elif kind == (True, "token"):
            activation = "dynamic_token"
        elif kind == (True, "group") and block is not None and a.get("group_size") == block[1]:
            activation = "dynamic_group"
        else:
            raise QuantizationError(
                f"{NAME}: input activations dynamic={kind[0]}, strategy={kind[1]!r}, group_size={a.get('group_size')!r} "
                f"are not served with {strategy} weights"
            )
    return Fp8Scheme(activation, block, "weight_scale")


class CompressedTensorsConfig:
    """Registered as `compressed-tensors` under the `quantization` kind (FP8 schemes)."""

    name: ClassVar[str] = NAME

    def __init__(self, groups: list[tuple[tuple[str, ...], Fp8Scheme]], ignore: tuple[str, ...]) -> None:
        self.groups = groups
        self.ignore = ignore
        self.packed_modules_mapping: dict[str, list[str]] = {}
        self.native_choices = NativeChoiceLog(NAME)  # this model's fp8 layer paths, logged once each

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        check_fields(NAME, config, ("config_groups", "ignore", "format", "quantization_status", "kv_cache_scheme",
                                    "sparsity_config", "transform_config"),
                     inert=("global_compression_ratio", "version", "provider"))
        if config.get("kv_cache_scheme") is not None:
            raise QuantizationError(f"{NAME}: kv_cache_scheme is not served; an fp8 KV cache is the kv_cache_dtype "
                                   "engine argument ('fp8'), which loads the checkpoint's k_scale / v_scale")
        for key in ("sparsity_config", "transform_config"):
            if config.get(key):
                raise QuantizationError(f"{NAME}: {key} is not served")
        if config.get("format") not in (None, "float-quantized", "naive-quantized"):
            raise QuantizationError(f"{NAME}: format {config['format']!r} is not served (fp8: float-quantized)")
        if config.get("quantization_status", "compressed") not in ("compressed", "frozen"):
            raise QuantizationError(f"{NAME}: quantization_status {config['quantization_status']!r} is not served")
        groups = config.get("config_groups") or {}
        if not groups:
            raise QuantizationError(f"{NAME}: config_groups is empty")
        parsed = [(tuple(g.get("targets") or ()), scheme_from(g)) for g in groups.values()]
        return cls(parsed, tuple(config.get("ignore") or ()))

    def validate(self, request: QuantizationRequest) -> list[str]:
        return validate_fp8(request)

    def _scheme_for(self, name: str) -> Fp8Scheme | None:
        for targets, scheme in self.groups:
            for t in targets:
                if t == "Linear" or (t.startswith("re:") and re.fullmatch(t[3:], name)) or t == name:
                    return scheme
        return None

    def get_quant_method(self, layer: LinearLayerSpec) -> Fp8LinearMethod | None:
        if is_layer_skipped(NAME, layer.prefix, self.ignore, self.packed_modules_mapping):
            return None
        parent, _, leaf = layer.prefix.rpartition(".")
        parts = [f"{parent}.{m}" for m in self.packed_modules_mapping.get(leaf, [leaf])]
        schemes = {self._scheme_for(p) for p in parts}
        if len(schemes) > 1:
            raise QuantizationError(f"{NAME}: fused layer {layer.prefix} packs {parts} with different schemes")
        scheme = schemes.pop()
        return None if scheme is None else Fp8LinearMethod(scheme, NAME, self.native_choices)

    def get_moe_method(self, spec: MoELayerSpec) -> Fp8MoEMethod | None:
        parts = [f"{spec.prefix}.{e}.{p}" for e in range(spec.num_experts) for p in EXPERT_PROJECTIONS]
        schemes = {self._scheme_for(p) for p in parts}
        if len(schemes) > 1:
            raise QuantizationError(f"{NAME}: the routed experts of {spec.prefix} use different schemes")
        scheme = schemes.pop()
        if scheme is None:
            return None
        return fp8_moe_method(NAME, scheme, spec, self.ignore, self.packed_modules_mapping)
