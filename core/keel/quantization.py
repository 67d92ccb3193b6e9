"""Quantization: a config read from the checkpoint, and a per-layer method that owns the weights.

A `QuantizationConfig` class is registered under the `quantization` kind with the key a checkpoint's
`quantization_config["quant_method"]` carries ("fp8", "awq", ...). Lifecycle:
1. `get_quantization_config(hf_config, plugins)` (model loader, startup) -> `cls.from_config(dict)`.
2. `config.get_quant_method(layer)` once per linear layer while the model is built; None means the
   layer stays unquantized (`UnquantizedLinearMethod`).
3. `method.create_weights(module, layer)` registers the parameters (each with a `weight_loader`).
4. Weight loading fills them; then `method.process_weights_after_loading(module)` once.
5. `method.apply(module, x, bias)` every forward.
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


class QuantizationConfig(Protocol):
    """Registered class (not instance) under the `quantization` kind."""

    name: ClassVar[str]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Called once at startup with the checkpoint's `quantization_config`; raises ValueError
        naming the field for a setting it does not support."""
        ...

    def supported_dtypes(self) -> tuple[Any, ...]:
        """Activation dtypes it works with; checked against the model dtype at startup."""
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
    """The checkpoint asks for a quantization no loaded plugin provides, or a malformed config."""


def get_quantization_config(hf_config: Any, plugins: PluginSet) -> QuantizationConfig | None:
    """The checkpoint's quantization config object, or None for an unquantized checkpoint."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    raw = dict(raw) if not isinstance(raw, dict) else raw
    method = raw.get("quant_method")
    if not isinstance(method, str) or not method:
        raise QuantizationError(f"quantization_config has no 'quant_method' string: {raw!r}")
    registry = plugins.registry("quantization")
    if method not in registry:
        from keel.plugins.errors import UnknownKeyError

        known = UnknownKeyError("quantization", method, registry)
        raise QuantizationError(f"checkpoint is quantized with {method!r}: {known}")
    return registry.get(method).from_config(raw)
