"""EngineArgs: the flat, user-facing engine arguments (vLLM names), CLI flags and their resolution.

Also importable as `keel.config.EngineArgs`. `create_engine_config` applies built-in defaults <
profile YAML < explicitly set arguments, then loads the plugins and applies the platform's and the
plugins' config patches (see keel.config).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from keel.config import (
    SECTION_CLASSES,
    CacheConfig,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

_SECTION_OF = {
    **dict.fromkeys(("model", "tokenizer", "dtype", "seed", "max_model_len", "skip_tokenizer_init",
                     "trust_remote_code", "revision", "served_model_name", "load_format", "generation_config",
                     "quantization", "logits_processors", "max_logprobs", "disable_shared_experts_fusion"),
                    "model"),
    **dict.fromkeys(("block_size", "enable_prefix_caching", "kv_cache_memory_bytes", "num_kv_blocks",
                     "gpu_memory_utilization", "kv_cache_dtype"), "cache"),
    **dict.fromkeys(("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "async_scheduling"),
                    "scheduler"),
    "scheduling_policy": "scheduler",
    **dict.fromkeys(("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "enable_expert_parallel",
                     "distributed_executor_backend", "engine_core_process", "engine_iteration_timeout_s"),
                    "parallel"),
    **dict.fromkeys(("platform", "attention_backend", "enforce_eager"), "device"),
}
# Overrides `platform: auto` below the profile and the flags (`--platform`).
PLATFORM_ENV = "KEEL_PLATFORM"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """'4GiB', '512MB', '1000' -> bytes (for --kv-cache-memory-bytes)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 1073741824, 4GiB, 512MB)")
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * (_UNITS[unit] if unit else 1))


_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgG])$")


def human_readable_int(text: str) -> int:
    """vLLM's integer syntax (--max-model-len 8k): k/m/g are 10**3/6/9 (25.6k -> 25600), K/M/G are
    2**10/20/30 (whole numbers only: 8K -> 8192); plain integers as they are."""
    value = str(text).strip()
    m = _HUMAN_INT.match(value)
    if m:
        number, suffix = m.groups()
        if suffix.islower():
            return int(float(number) * 10 ** {"k": 3, "m": 6, "g": 9}[suffix])
        if "." in number:
            raise argparse.ArgumentTypeError(f"{value!r}: no decimals with binary suffix {suffix} "
                                             f"(did you mean {number}{suffix.lower()}?)")
        return int(number) * 2 ** {"K": 10, "M": 20, "G": 30}[suffix]
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r} (examples: 4096, 8k, 8K)") from None


class _OneNameAction(argparse.Action):
    """--served-model-name takes vLLM's list syntax (NAME [NAME ...]); keel serves a model under one name."""

    def __call__(self, parser, namespace, values, option_string=None):
        if len(values) != 1:
            parser.error(f"{option_string}: keel serves a model under one name, got {len(values)}: {values}")
        setattr(namespace, self.dest, values[0])


# Short and vLLM-alias spellings of engine flags (vLLM's -tp / -pp / -q, --num-gpu-blocks-override).
_ALIASES = {
    "tensor_parallel_size": ("-tp",),
    "pipeline_parallel_size": ("-pp",),
    "data_parallel_size": ("-dp",),
    "quantization": ("-q",),
    "num_kv_blocks": ("--num-gpu-blocks-override",),
}
# What "not set" ends up as where the field's config section has no value of its own.
_UNSET_DEFAULTS = {
    "model": "none", "tokenizer": "the model's", "max_model_len": "the model's max_position_embeddings",
    "max_num_batched_tokens": "2048 with chunked prefill, else max_model_len",
    "async_scheduling": "on where the device runs apart from the host (not the CPU)",
    "kv_cache_memory_bytes": "from memory", "num_kv_blocks": "from the memory budget",
    "revision": "the default branch", "served_model_name": "the model", "quantization": "the checkpoint's",
    "distributed_executor_backend": "uni for one rank, else mp", "plugins": "auto", "profile": "none",
    "speculative_config": "off", "platform": "auto", "attention_backend": "auto (the platform's preference)",
}


def _default_text(name: str) -> str:
    section = _SECTION_OF.get(name)
    default: Any = None
    if section is not None:
        fields = {f.name: f.default for f in dataclasses.fields(SECTION_CLASSES[section])}
        default = fields.get(name)
        default = None if default is dataclasses.MISSING else default
    if default is None:
        return _UNSET_DEFAULTS.get(name, "off")
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


def _plugins_arg(text: str) -> list[str] | str:
    return "auto" if text == "auto" else [p.strip() for p in text.split(",") if p.strip()]


@dataclass
class EngineArgs:
    """Flat engine arguments with vLLM's names. None means "not set": the profile or default decides."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str | None = None
    seed: int | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    async_scheduling: bool | None = None  # None: on where the device runs asynchronously (not the CPU)
    skip_tokenizer_init: bool | None = None
    attention_backend: str | None = None
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float | None = None
    enforce_eager: bool | None = None
    platform: str | None = None
    plugins: list[str] | str | None = None  # entry-point names, or "auto"
    profile: str | None = None  # profile name or path
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    data_parallel_size: int | None = None  # engine replicas; with enable_expert_parallel, attention DP + MoE EP
    enable_expert_parallel: bool | None = None  # shard MoE experts over the TP x DP ranks
    distributed_executor_backend: str | None = None  # "uni", "mp", "ray" (an `executor` key); None: auto
    engine_core_process: bool | None = None  # the server's engine core in its own process
    engine_iteration_timeout_s: float | None = None  # the server's step watchdog (seconds; 0: off)
    speculative_config: dict[str, Any] | None = None  # {"method": ..., "num_speculative_tokens": ...}
    trust_remote_code: bool | None = None
    revision: str | None = None
    served_model_name: str | None = None
    load_format: str | None = None  # "auto" or "dummy" (random weights, no checkpoint needed)
    generation_config: str | None = None  # "auto" (the model's generation_config.json), "vllm", or a folder
    quantization: str | None = None  # a quantization method ("fp8", "gptq", ...); default: the checkpoint's
    kv_cache_dtype: str | None = None  # "auto" (the model dtype)
    scheduling_policy: str | None = None  # "fcfs" (default) or "priority" (requests' `priority` first)
    # logits_processor plugin keys or qualified class names ("pkg.module:Class"), or classes
    logits_processors: list[str | type] | None = None
    max_logprobs: int | None = None  # most logprobs a request may ask for (20); -1: the vocabulary size
    disable_shared_experts_fusion: bool | None = None  # MoE: keep shared experts out of the routed experts
    plugin_options: dict[str, Any] | None = None  # values of options plugins added to the CLI

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "plugin_options"]

    @classmethod
    def check_type(cls, name: str, value: Any) -> str | None:
        """Why `value` cannot be the value of field `name`, or None (used for profile values)."""
        hint = typing.get_type_hints(cls)[name]
        if _matches(value, hint):
            return None
        return f"expected {_hint_name(hint)}, got {value!r} ({type(value).__name__})"

    @classmethod
    def add_cli_args(cls, parser: Any) -> Any:
        """Add `--model`, `--block-size`, ... (all defaulting to "not set") to an argparse parser, with
        vLLM's spellings and value syntax; the help of each names its effective default."""
        from keel.engine_args_help import HELP

        group = parser.add_argument_group("engine arguments (override the profile)")
        bool_action = argparse.BooleanOptionalAction
        for f in dataclasses.fields(cls):
            if f.name == "plugin_options":
                continue
            flag = "--" + f.name.replace("_", "-")
            hint = typing.get_type_hints(cls)[f.name]
            help_text = f"{HELP[f.name]} (default: {_default_text(f.name)})".replace("%", "%%")
            kw: dict[str, Any] = {"default": None, "dest": f.name, "help": help_text}
            if f.name == "plugins":
                kw |= {"type": _plugins_arg, "metavar": "NAME,NAME|auto"}
            elif f.name == "kv_cache_memory_bytes":
                kw |= {"type": parse_size, "metavar": "BYTES"}
            elif f.name == "speculative_config":
                kw |= {"type": json.loads, "metavar": "JSON"}
            elif f.name == "logits_processors":
                kw |= {"nargs": "+", "metavar": "NAME"}
            elif f.name == "max_model_len":
                kw |= {"type": human_readable_int, "metavar": "N"}
            elif f.name == "served_model_name":
                kw |= {"nargs": "+", "action": _OneNameAction, "metavar": "NAME"}
            elif _matches(True, hint):
                kw |= {"action": bool_action}
            elif _matches(1, hint) and not _matches("x", hint):
                kw |= {"type": float if _matches(0.5, hint) else int}
            group.add_argument(*_ALIASES.get(f.name, ()), flag, **kw)
        if "enable_log_requests" in {f.name for f in dataclasses.fields(cls)}:
            # vLLM's older spelling: request logging used to be on unless this was given
            group.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                               default=None, help="do not log requests (default: not logged)")
        return parser

    @classmethod
    def from_cli_args(cls, ns: Any) -> EngineArgs:
        """From a parsed namespace; options that plugins added land in `plugin_options`."""
        values = {name: getattr(ns, name) for name in cls.field_names() if hasattr(ns, name)}
        extra = {d: getattr(ns, d) for d in getattr(ns, "_keel_plugin_option_dests", ()) if hasattr(ns, d)}
        return cls(**values, plugin_options=extra or None)

    def resolve(self) -> tuple[dict[str, Any], dict[str, str], Any]:
        """(effective flat values, where each came from: default|env|profile|args, the Profile)."""
        from keel.profile import DEFAULT_PROFILE, load_profile

        profile = load_profile(self.profile) if self.profile else DEFAULT_PROFILE
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for name, section in _SECTION_OF.items():
            cls = SECTION_CLASSES[section]
            default = {f.name: f.default for f in dataclasses.fields(cls)}.get(name, dataclasses.MISSING)
            values[name] = None if default is dataclasses.MISSING else default
            sources[name] = "default"
        values.update(plugins="auto", speculative_config=None)
        sources.update(plugins="default", speculative_config="default")
        if os.environ.get(PLATFORM_ENV):  # the default platform of this environment (a test suite pins it)
            values["platform"], sources["platform"] = os.environ[PLATFORM_ENV], "env"
        from_profile = {"plugins": profile.plugins, **dict(profile.engine)}
        if profile.platform != "auto":
            from_profile["platform"] = profile.platform
        if profile.attention_backend != "auto":
            from_profile["attention_backend"] = profile.attention_backend
        for name, value in from_profile.items():
            if value != "auto" or name == "plugins":
                values[name], sources[name] = value, "profile"
        for name in self.field_names():
            value = getattr(self, name)
            if value is not None and name != "profile":
                values[name], sources[name] = value, "args"
        return values, sources, profile

    def create_engine_config(self, require_model: bool = True) -> EngineConfig:
        """Resolve, validate, load the plugins, select the platform and apply the config patches.

        Raises ConfigError, ProfileError, PluginLoadError or PlatformError with a message naming
        the setting or plugin at fault.
        """
        values, _, profile = self.resolve()
        kwargs: dict[str, dict[str, Any]] = {s: {} for s in SECTION_CLASSES}
        for name, section in _SECTION_OF.items():
            kwargs[section][name] = values[name]
        if values["model"] is None:
            if require_model:
                raise ConfigError(
                    "model is not set: pass --model (or EngineArgs(model=...)) or set engine.model"
                )
            model = None
        else:
            model = ModelConfig(**kwargs["model"])
        chunked = kwargs["scheduler"]["enable_chunked_prefill"]
        if model is not None and (not chunked or kwargs["model"]["max_model_len"] is not None):
            kwargs["scheduler"]["max_model_len"] = model.derived_max_model_len
        spec = values["speculative_config"]
        if spec is not None and not isinstance(spec, Mapping):
            raise ConfigError(f"speculative_config must be a mapping, got {spec!r}")
        names = [f.name for f in dataclasses.fields(SpeculativeConfig)]
        for key in spec or {}:
            if key not in names:
                from keel.plugins.errors import suggest

                raise ConfigError(f"speculative_config: unknown key {key!r}{suggest(key, names)}")
        plugins = values["plugins"]
        config = EngineConfig(
            model=model,
            cache=CacheConfig(**kwargs["cache"]),
            scheduler=SchedulerConfig(**kwargs["scheduler"]),
            parallel=ParallelConfig(**kwargs["parallel"]),
            device=DeviceConfig(**kwargs["device"]),
            speculative=SpeculativeConfig(**spec) if spec is not None else None,
            plugins=plugins if plugins == "auto" else tuple(plugins),
            profile_path=profile.path,
            plugin_options=dict(self.plugin_options or {}),
        )
        return _finish(config)


@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs plus the settings of the server's front end (`AsyncLLM`), as vLLM's AsyncEngineArgs."""

    disable_log_stats: bool | None = None  # no periodic throughput / cache-usage log line
    enable_log_requests: bool | None = None  # log each request's prompt and sampling parameters


def _finish(config: EngineConfig) -> EngineConfig:
    """Load plugins, resolve platform and named attention backend, apply platform and hook patches."""
    plugin_set = config.plugin_set()
    platform = config.platform()
    resolved = dataclasses.replace(config.device, platform=platform.name)
    config = dataclasses.replace(config, device=resolved, plugins=tuple(plugin_set.names))
    config.__dict__.update(_cached_plugins=plugin_set, _cached_platform=platform)
    config = config.with_patch(platform.adjust_config(config))
    # pluggy returns results last-registered first; apply them in plugin load order.
    for patch in reversed(plugin_set.hooks.hook.keel_adjust_config(config=config)):
        config = config.with_patch(patch)
    executor_cls = plugin_set.registry("executor").get(config.parallel.executor_backend)  # unknown: lists them
    executor_cls.validate_config(config, platform)
    quantization = config.model.quantization if config.model is not None else None
    if quantization is not None and quantization not in plugin_set.registry("quantization"):
        from keel.plugins.errors import UnknownKeyError
        from keel.quantization import QuantizationError

        known = UnknownKeyError("quantization", quantization, plugin_set.registry("quantization"))
        raise QuantizationError(f"quantization={quantization!r}: {known}")
    if config.model is not None and config.model.logits_processors:
        _check_logits_processors(config, plugin_set)
    backend = config.device.attention_backend
    if backend != "auto":
        plugin_set.registry("attention_backend").ref(backend)  # unknown key: error listing the known
    return config


def _check_logits_processors(config: EngineConfig, plugin_set: Any) -> None:
    """Every named logits processor resolves (a name nothing provides stops startup, naming it)."""
    from keel.logits_processor import resolve_logits_processors

    if config.speculative is not None:
        raise ConfigError("logits_processors are not supported with speculative_config yet (verify rows are "
                          "not laid out for them): turn one of them off")
    try:
        resolve_logits_processors(config.model.logits_processors, plugin_set)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _hint_name(hint: Any) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if not args:
        return getattr(hint, "__name__", str(hint))
    return " or ".join(getattr(a, "__name__", str(a)) for a in args)

