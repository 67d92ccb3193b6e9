"""Quantization: a config read from the checkpoint, and a per-layer method that owns the weights.

A `QuantizationConfig` class is registered under the `quantization` kind with the key a checkpoint's
`quantization_config["quant_method"]` carries ("fp8", "gptq", ...). Lifecycle:
1. `resolve_quantization(model_config, plugins, request)` (config creation and the worker, at startup)
   -> `cls.from_config(dict)` for a quantized checkpoint, or `cls.from_online()` when the user asks for
   a method on an unquantized one; then `config.validate(request)` (platform, dtype) must return no
   reasons. Every failure is a `QuantizationError` naming the method and the reason: never a silent
   fallback to unquantized weights.
2. `config.get_quant_method(layer)` once per linear layer while the model is built; None means the
   layer stays unquantized (the plain dense weight). A layer the method cannot serve raises
   `QuantizationError` naming it.
3. `method.create_weights(module, layer)` registers the parameters (each with a `weight_loader`).
4. Weight loading fills them; then `method.process_weights_after_loading(module)` once.
5. `method.apply(module, x, bias)` every forward.

Routed experts (`FusedMoE`) ask `config.get_moe_method(spec)` instead (see `moe_quant_method`); the
returned `FusedMoEMethod` follows the same create / load / process / apply steps for the stacked experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from keel.plugins.loader import PluginSet


@dataclass(frozen=True)
class LinearLayerSpec:
    """A linear layer as the model builds it. Frozen: fields are only ever added.

    `output_partition_sizes` are this rank's output slices (e.g. q, k, v of a fused qkv projection).
    """

    prefix: str  # parameter path, e.g. "model.layers.0.self_attn.qkv_proj"
    input_size: int  # this rank's input features
    output_partition_sizes: tuple[int, ...]
    params_dtype: Any  # torch.dtype
    bias: bool = False


@dataclass(frozen=True)
class MoELayerSpec:
    """A FusedMoE layer as the model builds it (this rank's share). Frozen: fields are only ever added."""

    prefix: str  # e.g. "model.layers.1.mlp.experts"; checkpoint names are f"{prefix}.{e}.gate_proj" ...
    num_experts: int  # all experts (checkpoint ids)
    local_num_experts: int  # stored on this rank
    hidden_size: int
    intermediate_size_per_partition: int  # this rank's slice of each expert's intermediate size
    params_dtype: Any  # torch.dtype


@dataclass(frozen=True)
class QuantizationRequest:
    """Where a quantization method is asked to run. Frozen: fields are only ever added."""

    platform: str  # the platform's registry key
    device_type: str  # torch device type
    dtype: Any  # the model (activation) dtype, a torch.dtype
    supports_fp8: bool = False  # the platform computes in fp8 natively (else emulated or dequantized)


@runtime_checkable
class QuantizationMethod(Protocol):
    """Per-layer: creates, post-processes and applies the (quantized) weights."""

    def create_weights(self, module: torch.nn.Module, layer: LinearLayerSpec) -> None:
        """Called once while the model is built; registers parameters on `module`."""
        ...

    def process_weights_after_loading(self, module: torch.nn.Module) -> None:
        """Called once after every checkpoint tensor is loaded (repacking, scale fusion, ...)."""
        ...

    def apply(
        self,
        module: torch.nn.Module,
        x: torch.Tensor,  # [num_tokens, input_size]
        bias: torch.Tensor | None = None,  # [output_size]
    ) -> torch.Tensor:  # [num_tokens, sum(output_partition_sizes)]
        """Called every forward pass."""
        ...


@runtime_checkable
class PermutedInputMethod(Protocol):
    """Optional, for a `QuantizationMethod` that serves some layers with their inputs permuted (GPTQ's act order,
    put in group order after loading) and so gathers the activations' columns every forward. Where the model
    declares that a layer's input is made from another layer's outputs (`LinearBase.set_input_source`), the
    loader folds the permutation into that producer once (`keel.layers.linear.fold_input_permutations`), and the
    gather is gone."""

    def take_input_permutation(self, module: torch.nn.Module) -> torch.Tensor | None:
        """Called by the loader after `process_weights_after_loading`: this layer's input permutation ([in] int,
        kernel input j reads activation column perm[j]) or None; once returned, the layer no longer applies it
        (its input arrives permuted)."""
        ...

    def permute_outputs(self, module: torch.nn.Module, index: torch.Tensor) -> None:
        """Called by the loader after `process_weights_after_loading`: reorder this layer's outputs so that output
        j becomes what output index[j] was (the layer's bias is permuted by the caller)."""
        ...


@runtime_checkable
class FusedMoEMethod(Protocol):
    """Per FusedMoE layer: creates, post-processes and applies the quantized expert weights."""

    def create_weights(self, layer: torch.nn.Module, spec: MoELayerSpec) -> None:
        """Called once while the layer is built; registers `w13_*` / `w2_*` parameters on it, each with a
        `weight_loader(param, tensor, shard_id=(expert, "w1" | "w2" | "w3"))` and `shard_ids`."""
        ...

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Called once after every checkpoint tensor is loaded (repacking into the runtime form)."""
        ...

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> Any:
        """Called after loading, by kernel providers at bind time (`supports_layer`) and by `apply`: the
        `keel.layers.fused_moe.quant_config.FusedMoEQuantConfig` describing the stored experts."""
        ...

    def apply(
        self,
        layer: torch.nn.Module,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
        topk_ids: torch.Tensor,  # [num_tokens, top_k] int (this rank's expert ids)
        residual: torch.Tensor | None,  # [num_tokens, hidden_size], added to the result
        fused_experts: Any,  # the layer's bound `fused_experts` op, or None: the method's torch reference
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """Called every forward by the layer, after routing."""
        ...


class QuantizationConfig(Protocol):
    """Registered class (not instance) under the `quantization` kind.

    Optional members: `from_online()` (classmethod) for methods that quantize an unquantized checkpoint
    at load; `get_moe_method(spec: MoELayerSpec) -> FusedMoEMethod | None` for methods that serve
    quantized routed experts (None: that layer's experts stay unquantized); `prepare_checkpoint(weights)` to rewrite the checkpoint's tensor stream; a method's `dequantize_weight(module) -> [out, in]` for layers that read their weight
    directly (MLA absorbs kv_b_proj; see `dense_weight`).
    """

    name: ClassVar[str]
    # Fused parameter -> the checkpoint modules it packs (the model's `packed_modules_mapping`), set by
    # `resolve_quantization`, so per-module settings (ignore lists) map onto fused layers.
    packed_modules_mapping: dict[str, list[str]]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Called once at startup with the checkpoint's `quantization_config`; raises QuantizationError
        naming the field for a setting it does not support (an unknown field included)."""
        ...

    def validate(self, request: QuantizationRequest) -> list[str]:
        """Called once at startup: why this method cannot run there (empty when it can)."""
        ...

    def get_quant_method(self, layer: LinearLayerSpec) -> QuantizationMethod | None:
        """Called once per linear layer while the model is built; None keeps it unquantized."""
        ...


class UnquantizedLinearMethod:
    """The default method: a plain dense weight [out, in] and `F.linear`."""

    def create_weights(self, module: torch.nn.Module, layer: LinearLayerSpec) -> None:
        import torch

        out = sum(layer.output_partition_sizes)
        weight = torch.empty(out, layer.input_size, dtype=layer.params_dtype)
        module.register_parameter("weight", torch.nn.Parameter(weight, requires_grad=False))

    def process_weights_after_loading(self, module: torch.nn.Module) -> None:
        return None

    def apply(
        self,
        module: torch.nn.Module,
        x: torch.Tensor,  # [num_tokens, input_size]
        bias: torch.Tensor | None = None,  # [output_size]
    ) -> torch.Tensor:  # [num_tokens, output_size]
        import torch.nn.functional as F

        return F.linear(x, module.weight, bias)


class QuantizationError(ValueError):
    """A quantization no loaded plugin provides, a malformed config, or one that cannot run here."""


def dense_weight(module: torch.nn.Module) -> torch.Tensor:  # [out, in] in the model dtype
    """A linear layer's weight as a dense tensor: its own, or its quantization method's dequantized one.

    Called after loading by layers that consume the weight matrix itself instead of the forward.
    """
    method = getattr(module, "quant_method", None)
    if method is None:
        return module.weight
    dequantize = getattr(method, "dequantize_weight", None)
    if dequantize is None:
        raise QuantizationError(
            f"{getattr(module, 'prefix', type(module).__name__)}: quantization method "
            f"{type(method).__name__} cannot dequantize its weight, which this layer reads directly"
        )
    return dequantize(module)


def moe_quant_method(quant_config: Any, spec: MoELayerSpec) -> FusedMoEMethod | None:
    """The method for one FusedMoE layer (called while it is built), or None for dense experts. A config
    without `get_moe_method` cannot lay out quantized experts: an error naming the method and the layer."""
    if quant_config is None:
        return None
    get = getattr(quant_config, "get_moe_method", None)
    if get is None:
        raise QuantizationError(
            f"quantization {getattr(quant_config, 'name', type(quant_config).__name__)!r} has no fused-MoE method; "
            f"it cannot serve the routed experts of {spec.prefix}"
        )
    return get(spec)


def prepare_checkpoint(quant_config: Any, weights: Any) -> Any:
    """The checkpoint's (name, tensor) stream as the model loads it. Called by the model loader and by
    draft-model loaders: a config with a `prepare_checkpoint(weights)` member may rewrite tensors first."""
    hook = getattr(quant_config, "prepare_checkpoint", None)
    return weights if hook is None else hook(weights)


def checkpoint_quantization(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` as a dict, or None."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(raw)
    return raw


def resolve_quantization(
    hf_config: Any, requested: str | None, plugins: PluginSet, request: QuantizationRequest,
    packed_modules_mapping: dict[str, list[str]] | None = None,
) -> QuantizationConfig | None:
    """The quantization config to build the model with, or None for an unquantized model.

    `requested` is the `quantization` engine argument. With a quantized checkpoint it must be None or
    the checkpoint's method; on an unquantized checkpoint it asks for online quantization.
    """
    raw = checkpoint_quantization(hf_config)
    method = None
    if raw is not None:
        method = raw.get("quant_method")
        if not isinstance(method, str) or not method:
            raise QuantizationError(f"quantization_config has no 'quant_method' string: {raw!r}")
        if requested is not None and requested != method:
            raise QuantizationError(
                f"quantization={requested!r} was requested but the checkpoint is quantized with {method!r}; "
                f"leave quantization unset or pass {method!r}"
            )
    elif requested is not None:
        method = requested
    if method is None:
        return None
    registry = plugins.registry("quantization")
    if method not in registry:
        from keel.plugins.errors import UnknownKeyError

        known = UnknownKeyError("quantization", method, registry)
        where = "the checkpoint is quantized with" if raw is not None else "quantization="
        raise QuantizationError(f"{where} {method!r}, which no loaded plugin provides: {known}")
    cls = registry.get(method)
    if raw is not None:
        config = cls.from_config(raw)
    else:
        online = getattr(cls, "from_online", None)
        if online is None:
            raise QuantizationError(
                f"quantization {method!r} needs a checkpoint quantized with it (config.json "
                "quantization_config); this checkpoint is not quantized and the method cannot quantize online"
            )
        config = online()
    reasons = config.validate(request)
    if reasons:
        raise QuantizationError(
            f"quantization {method!r} cannot run on platform {request.platform!r} "
            f"({request.device_type}, {request.dtype}): " + "; ".join(reasons)
        )
    config.packed_modules_mapping = dict(packed_modules_mapping or {})
    return config


def quantization_for_model(config: Any, model_cls: type, platform: Any, dtype: Any) -> QuantizationConfig | None:
    """The worker's call at model build: `resolve_quantization` for this engine config and model class,
    which must declare the `quantization` capability (`packed_modules_mapping`) when quantized."""
    from keel.models.capabilities import supports

    mc = config.model
    request = QuantizationRequest(platform=platform.name, device_type=platform.device_type, dtype=dtype,
                                  supports_fp8=bool(getattr(platform, "supports_fp8", False)))
    mapping = getattr(model_cls, "packed_modules_mapping", None)
    quant = resolve_quantization(mc.hf_config, mc.quantization, config.plugin_set(), request, mapping)
    if quant is not None and not supports(model_cls, "quantization"):
        raise QuantizationError(
            f"{model_cls.__name__} does not support quantization (it declares no packed_modules_mapping); "
            f"cannot serve it with {quant.name!r}"
        )
    return quant
