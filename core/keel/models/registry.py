"""Model registry: HF `config.json` architecture name -> lazily imported model class (`model_arch` kind).

Called by the worker when it builds the model (`resolve_hf_config`); `inspect_model_cls` answers what a
model supports without building it or loading weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from keel.models.capabilities import model_capabilities
from keel.plugins.errors import suggest

if TYPE_CHECKING:
    from keel.plugins.loader import PluginSet


class UnsupportedArchitectureError(ValueError):
    """No loaded plugin serves any of the checkpoint's architectures."""


@dataclass(frozen=True)
class ModelInfo:
    """What a model class supports. Frozen: fields are only ever added."""

    architecture: str
    provider: str  # plugin and distribution
    capabilities: frozenset[str]

    @property
    def is_text_generation_model(self) -> bool:
        return "text_generation" in self.capabilities

    @property
    def is_pooling_model(self) -> bool:
        return "pooling" in self.capabilities

    @property
    def supports_mtp(self) -> bool:
        return "mtp" in self.capabilities

    @property
    def supports_tensor_parallel(self) -> bool:
        return "tensor_parallel" in self.capabilities


class ModelRegistry:
    """Typed view of the `model_arch` registry of a plugin set."""

    def __init__(self, plugins: PluginSet) -> None:
        self._registry = plugins.registry("model_arch")

    def get_supported_archs(self) -> list[str]:
        return sorted(self._registry.keys())

    def _pick(self, architectures: Sequence[str] | str, model: str = "") -> str:
        archs = [architectures] if isinstance(architectures, str) else list(architectures)
        for arch in archs:
            if arch in self._registry:
                return arch
        supported = self.get_supported_archs()
        hint = suggest(archs[0], supported) if archs else ""
        of_model = f" of {model!r}" if model else ""
        raise UnsupportedArchitectureError(
            f"no loaded plugin serves architecture(s) {archs}{of_model}{hint}; supported: "
            f"{', '.join(supported) or 'none'}. Install the model plugin and list it in `plugins:`"
        )

    def resolve_model_cls(self, architectures: Sequence[str] | str, model: str = "") -> tuple[Any, str]:
        """(model class, architecture) for the first of `architectures` that is registered.

        `model` (the checkpoint's name or path) only makes the error message name it.
        """
        arch = self._pick(architectures, model)
        return self._registry.get(arch), arch

    def inspect_model_cls(self, architectures: Sequence[str] | str) -> ModelInfo:
        """Capabilities of the model class, by structure; imports the class but never builds it."""
        model_cls, arch = self.resolve_model_cls(architectures)
        return ModelInfo(arch, str(self._registry.provider(arch)), model_capabilities(model_cls))

    def resolve_hf_config(self, hf_config: Any, model: str = "") -> tuple[Any, str]:
        """Like `resolve_model_cls` for a transformers config's `architectures`; the worker's lookup."""
        archs = list(getattr(hf_config, "architectures", None) or [])
        if not archs:
            name = f"{model!r}" if model else "the model"
            raise UnsupportedArchitectureError(f"the config.json of {name} declares no `architectures`")
        return self.resolve_model_cls(archs, model)


def is_pooling_model(config: Any) -> bool:
    """Whether the engine config's model is a pooling (embedding) model, which serves pooling requests
    only. Called by the front ends (AsyncLLM, LLMEngine) to refuse generation on it before queuing."""
    archs = getattr(config.model.hf_config, "architectures", None) or []
    return bool(archs) and ModelRegistry(config.plugin_set()).inspect_model_cls(archs).is_pooling_model
