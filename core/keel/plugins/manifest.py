"""What a plugin declares about itself, read at discovery without importing anything heavy.

Each entry point in the group `keel.plugins` resolves to a zero-argument callable (or a constant)
returning a `PluginManifest`. The module holding it must import nothing but `keel.plugins.manifest`:
discovery runs on every `keel` start, and a component is imported only when selected.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

# Registry kinds the core knows. Keys inside a kind are open strings.
KINDS: tuple[str, ...] = (
    "platform",
    "attention_backend",
    "model_arch",
    "quantization",
    "kv_connector",
    "io_processor",
    "endpoint",
    "stat_logger",
    "kv_cache_spec",
    "spec_decoder",
    "custom_op",
    "executor",
    "structured_output",
    "logits_processor",
    "reasoning_parser",
    "tool_parser",
)


@dataclass(frozen=True)
class PluginManifest:
    """A plugin's self-description.

    name:      the entry-point name (`platform-cpu`, `models-llama`, ...).
    version:   the plugin's own version.
    core_api:  a version range of the core plugin API it supports (`">=1.0,<2"`).
    provides:  per registry kind, registry key -> lazy reference `"package.module:attr"`.
    hooks:     optional lazy references to pluggy hook implementation objects (lifecycle events).
    """

    name: str
    version: str
    core_api: str
    provides: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    hooks: tuple[str, ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        frozen = {kind: MappingProxyType(dict(keys)) for kind, keys in dict(self.provides).items()}
        object.__setattr__(self, "provides", MappingProxyType(frozen))
        object.__setattr__(self, "hooks", tuple(self.hooks))
