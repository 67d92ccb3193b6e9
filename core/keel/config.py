"""Engine configuration: typed, validated sections (vLLM names) and `EngineArgs`, the flat user input.

Precedence, applied by `EngineArgs.create_engine_config`: built-in defaults < profile YAML < the
arguments explicitly set (an `EngineArgs` field left at None is "not set"). Then the selected
platform's `adjust_config` patch and the plugins' `keel_adjust_config` patches are applied.
Sections are frozen; change one with `EngineConfig.with_patch`, which validates again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from keel.platform import Platform
    from keel.plugins.loader import PluginSet


def __getattr__(name: str) -> Any:
    # EngineArgs lives in keel.engine_args (it imports this module); keel.config.EngineArgs still works.
    if name == "EngineArgs":
        from keel.engine_args import EngineArgs

        return EngineArgs
    raise AttributeError(f"module 'keel.config' has no attribute {name!r}")


class ConfigError(ValueError):
    """An invalid engine setting; the message names the field and the accepted values."""


LOAD_FORMATS = ("auto", "dummy")
# "auto": the model dtype. "fp8" / "fp8_e4m3": e4m3 storage with unit scales (vLLM's names); e5m2 and
# per-layer checkpoint scales are not served yet.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
SCHEDULING_POLICIES = ("fcfs", "priority")
DTYPE_NAMES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
               "bfloat16": "bfloat16"}


def _positive(section: str, name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{section}.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str | None = None  # defaults to `model`
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    revision: str | None = None
    served_model_name: str | None = None  # defaults to `model`
    load_format: str = "auto"  # "auto": the checkpoint's weights; "dummy": random weights (benchmarks)
    # "auto": the model folder's generation_config.json (default sampling settings, extra EOS ids);
    # "vllm" / "none": ignore it; or a folder holding a generation_config.json (vLLM's flag)
    generation_config: str = "auto"
    # A `quantization` registry key. None: the checkpoint's `quantization_config` decides (unquantized
    # without one); set on an unquantized checkpoint it asks for online quantization (e.g. "fp8").
    quantization: str | None = None
    # Batch-level logits processors (vLLM's): `logits_processor` registry keys, "pkg.module:Class" names
    # or classes; every worker builds one of each (keel.logits_processor).
    logits_processors: tuple[Any, ...] = ()
    # Most logprobs / prompt_logprobs a request may ask for (vLLM's default 20); -1: the vocabulary size.
    max_logprobs: int = 20
    # MoE models with shared experts (DeepSeek) fuse them into the routed experts where the layout allows
    # (SGLang's flag name); True keeps the shared MLP separate. A model without MoE layers refuses it.
    disable_shared_experts_fusion: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.disable_shared_experts_fusion, bool):
            raise ConfigError(f"model.disable_shared_experts_fusion must be a boolean, got "
                              f"{self.disable_shared_experts_fusion!r}")
        m = self.max_logprobs
        if isinstance(m, bool) or not isinstance(m, int) or m < -1:
            raise ConfigError(f"model.max_logprobs must be an integer >= -1 (-1: the vocabulary size), got {m!r}")
        procs = self.logits_processors
        if isinstance(procs, (str, type)) or not isinstance(procs, (list, tuple)) or any(
                not (isinstance(p, type) or (isinstance(p, str) and p)) for p in procs):
            raise ConfigError("model.logits_processors must be a list of logits_processor names or classes, "
                              f"got {procs!r}")
        object.__setattr__(self, "logits_processors", tuple(procs))
        if self.quantization is not None and (not isinstance(self.quantization, str) or not self.quantization):
            raise ConfigError(f"model.quantization must be a quantization method name, got {self.quantization!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"model.load_format {self.load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"model.model must be a model directory or name, got {self.model!r}")
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"model.dtype {self.dtype!r} is not one of auto, {', '.join(DTYPE_NAMES)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"model.seed must be an integer, got {self.seed!r}")
        _positive("model", "max_model_len", self.max_model_len, allow_none=True)
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ConfigError(f"model.generation_config must be auto, vllm or a folder, got {self.generation_config!r}")
        object.__setattr__(self, "tokenizer", self.tokenizer or self.model)
        object.__setattr__(self, "served_model_name", self.served_model_name or self.model)

    @cached_property
    def hf_config(self) -> Any:
        """The checkpoint's transformers config, loaded on first use."""
        from transformers import AutoConfig

        from keel.models.checkpoint_files import check_config_dir, local_model_dir, one_line

        local = local_model_dir(self.model)
        if local is not None:
            check_config_dir(local)
        try:
            return AutoConfig.from_pretrained(
                self.model, trust_remote_code=self.trust_remote_code, revision=self.revision
            )
        except Exception as exc:
            raise ConfigError(f"model.model: cannot load the config of {self.model!r}: {one_line(exc)}") from exc

    @cached_property
    def generation_config_fields(self) -> dict[str, Any]:
        """What keel uses of the generation config (`eos_token_id`, default sampling fields); {} if none."""
        from keel.models.generation_config import GenerationConfigError, read_generation_config

        model_dir = None
        if self.generation_config == "auto":
            from keel.models.loader import resolve_model_path

            try:
                model_dir = resolve_model_path(self.model, self.revision)
            except Exception:  # a hub id without a network: the weights' loader reports that
                return {}
        try:
            return read_generation_config(self.generation_config, model_dir)
        except GenerationConfigError as exc:
            raise ConfigError(f"model.generation_config: {exc}") from exc

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype to run in: the named one, or for "auto" the checkpoint's (float32 if absent)."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, DTYPE_NAMES[self.dtype])
        declared = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        if isinstance(declared, str):
            declared = getattr(torch, DTYPE_NAMES.get(declared, declared), None)
        return declared if isinstance(declared, torch.dtype) else torch.float32

    @property
    def derived_max_model_len(self) -> int:
        """`max_model_len`, or the checkpoint's `max_position_embeddings`; never above the latter."""
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        if self.max_model_len is None:
            if limit is None:
                raise ConfigError(f"model.max_model_len must be set: {self.model!r} declares no maximum")
            return int(limit)
        if limit is not None and self.max_model_len > limit:
            raise ConfigError(
                f"model.max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {limit}"
            )
        return self.max_model_len


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None  # explicit KV cache budget; else from memory profiling
    num_kv_blocks: int | None = None  # explicit block count; overrides both budgets
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype), "fp8" / "fp8_e4m3"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"cache.kv_cache_dtype {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)} "
                "(fp8 means e4m3; e5m2 is not served)"
            )
        _positive("cache", "block_size", self.block_size)
        _positive("cache", "kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        _positive("cache", "num_kv_blocks", self.num_kv_blocks, allow_none=True)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, int | float) or not 0 < u <= 1:
            raise ConfigError(f"cache.gpu_memory_utilization must be in (0, 1], got {u!r}")

    def torch_kv_cache_dtype(self) -> torch.dtype | None:
        """The KV cache's storage dtype, or None for the model dtype."""
        import torch

        return None if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 2048 with chunked prefill, else max_model_len
    enable_chunked_prefill: bool = True
    # Schedule step N+1 while step N runs on the device. None: on where the device runs asynchronously
    # to the host (not the CPU), speculative decoding or not.
    async_scheduling: bool | None = None
    max_model_len: int | None = None  # filled in by create_engine_config when the model is known
    # "fcfs": arrival order. "priority": requests' `priority` first (lower is sooner), then arrival; the
    # lowest-priority running request is the one preempted (vLLM's --scheduling-policy).
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduler.scheduling_policy {self.scheduling_policy!r} is not one of "
                              f"{', '.join(SCHEDULING_POLICIES)}")
        _positive("scheduler", "max_num_seqs", self.max_num_seqs)
        _positive("scheduler", "max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        if self.max_num_batched_tokens is None:
            default = 2048 if self.enable_chunked_prefill else self.max_model_len
            object.__setattr__(self, "max_num_batched_tokens", default)
        mbt = self.max_num_batched_tokens
        too_small = mbt is not None and self.max_model_len is not None and mbt < self.max_model_len
        if not self.enable_chunked_prefill and too_small:
            raise ConfigError(
                f"scheduler.max_num_batched_tokens ({mbt}) is smaller than max_model_len "
                f"({self.max_model_len}) with chunked prefill off: long prompts could never be scheduled"
            )


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Engine replicas (vLLM's name): each data-parallel rank schedules its own requests into its own KV
    # cache. A MoE model with expert parallelism runs its attention DP and its experts EP over the same
    # ranks (DeepSeek's layout): tokens are gathered to the experts and back every MoE layer.
    data_parallel_size: int = 1
    # MoE experts are sharded over the expert-parallel group (the tensor-parallel ranks x the
    # data-parallel ranks) instead of each expert being split by tensor parallelism (vLLM's name and meaning).
    enable_expert_parallel: bool = False
    # An `executor` registry key ("uni": the worker in the engine core's process; "mp": one process per
    # rank; "ray": Ray actors). None: "uni" for one rank, else "mp".
    distributed_executor_backend: str | None = None
    # AsyncLLM (the server) runs the engine core in its own process instead of on a thread, so HTTP and
    # tokenizer work never share the GIL with scheduling and batch building.
    engine_core_process: bool = False
    # AsyncLLM's step watchdog (vLLM: VLLM_ENGINE_ITERATION_TIMEOUT_S): an engine core that finishes no
    # step and sends no heartbeat for this long is declared dead (requests fail, /health is 503; a core
    # process is killed). 0 turns it off. Offline LLM / LLMEngine step in the caller's thread: no watchdog.
    engine_iteration_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _positive("parallel", "tensor_parallel_size", self.tensor_parallel_size)
        t = self.engine_iteration_timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < float("inf"):
            raise ConfigError(
                f"parallel.engine_iteration_timeout_s must be a number of seconds >= 0 (0: no watchdog), got {t!r}"
            )
        _positive("parallel", "pipeline_parallel_size", self.pipeline_parallel_size)
        _positive("parallel", "data_parallel_size", self.data_parallel_size)
        if not isinstance(self.enable_expert_parallel, bool):
            raise ConfigError(f"parallel.enable_expert_parallel must be a boolean, got {self.enable_expert_parallel!r}")
        backend = self.distributed_executor_backend
        if backend is not None and (not isinstance(backend, str) or not backend):
            raise ConfigError(f"parallel.distributed_executor_backend must be an executor key, got {backend!r}")
        if backend == "uni" and self.world_size > 1:
            raise ConfigError(
                f"parallel.distributed_executor_backend 'uni' runs one worker, but tensor_parallel_size x "
                f"pipeline_parallel_size x data_parallel_size is {self.world_size}: use 'mp' (or 'ray')"
            )
        if self.enable_expert_parallel and self.tensor_parallel_size * self.data_parallel_size == 1:
            raise ConfigError("parallel.enable_expert_parallel shards experts over the tensor- and data-parallel "
                              "ranks: set tensor_parallel_size or data_parallel_size > 1 (or turn it off)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def executor_backend(self) -> str:
        """The `executor` registry key to use (the default resolved)."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"


@dataclass(frozen=True)
class DeviceConfig:
    platform: str = "auto"  # a `platform` registry key, or auto
    attention_backend: str = "auto"  # an `attention_backend` registry key, or auto
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        for name in ("platform", "attention_backend"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"device.{name} must be a registry key or 'auto', got {value!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # a `spec_decoder` registry key, e.g. "ngram", "mtp"
    num_speculative_tokens: int = 1
    prompt_lookup_min: int = 1  # ngram: shortest suffix to match
    prompt_lookup_max: int = 4  # ngram: longest suffix to match

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise ConfigError(f"speculative.method must be a non-empty string, got {self.method!r}")
        _positive("speculative", "num_speculative_tokens", self.num_speculative_tokens)


SECTIONS = ("model", "cache", "scheduler", "parallel", "device", "speculative")


@dataclass(frozen=True)
class EngineConfig:
    """The validated configuration of one engine; picklable, travels to workers.

    `plugins` is the resolved plugin list (never "auto" after create_engine_config), so a worker
    calling `plugin_set()` loads exactly its parent's plugins.
    """

    model: ModelConfig | None  # None only for `keel profile show` without a model
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    speculative: SpeculativeConfig | None = None
    plugins: tuple[str, ...] | Literal["auto"] = "auto"
    profile_path: str | None = None
    plugin_options: Mapping[str, Any] = field(default_factory=dict)

    def with_patch(self, patch: Mapping[str, Mapping[str, Any]] | None) -> EngineConfig:
        """A new config with `{section: {field: value}}` applied and validated; self is unchanged."""
        from keel.plugins.errors import suggest

        if not patch:
            return self
        changes: dict[str, Any] = {}
        for section, values in patch.items():
            if section not in SECTIONS:
                hint = suggest(section, SECTIONS)
                raise ConfigError(f"config patch names unknown section {section!r}{hint}")
            current = getattr(self, section)
            if current is None:
                raise ConfigError(f"config patch changes section {section!r}, which is not configured")
            names = [f.name for f in dataclasses.fields(current)]
            for key in values:
                if key not in names:
                    hint = suggest(key, names)
                    raise ConfigError(f"config patch names unknown field {section}.{key}{hint}")
            changes[section] = dataclasses.replace(current, **values)
        new = dataclasses.replace(self, **changes)
        new.__dict__.update({k: v for k, v in self.__dict__.items() if k.startswith("_cached_")})
        return new

    def plugin_set(self) -> PluginSet:
        """The loaded plugins (loaded once per process; workers load them here)."""
        if "_cached_plugins" not in self.__dict__:
            from keel.plugins.loader import load_plugins

            self.__dict__["_cached_plugins"] = load_plugins(
                self.plugins if self.plugins == "auto" else list(self.plugins)
            )
        return self.__dict__["_cached_plugins"]

    def platform(self) -> Platform:
        """The selected platform instance (`device.platform`, resolved by create_engine_config)."""
        if "_cached_platform" not in self.__dict__:
            from keel.platform import select_platform

            self.__dict__["_cached_platform"] = select_platform(self, self.plugin_set())
        return self.__dict__["_cached_platform"]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"plugins": self.plugins if self.plugins == "auto" else list(self.plugins)}
        for section in SECTIONS:
            value = getattr(self, section)
            out[section] = None if value is None else dataclasses.asdict(value)
        out["profile_path"] = self.profile_path
        if self.plugin_options:
            out["plugin_options"] = dict(self.plugin_options)
        return out

    def __getstate__(self) -> dict[str, Any]:
        # Loaded plugins and the platform instance stay in their process; a worker loads its own.
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_cached_")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


SECTION_CLASSES: dict[str, type] = {
    "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
    "parallel": ParallelConfig, "device": DeviceConfig,
}
