"""The `logits_processor` plugin kind: batch-level logits processors, vLLM v1's interface.

Who calls what, and when:
- The engine resolves `logits_processors` (engine argument / `keel serve --logits-processors`: registry
  keys of `logits_processor` plugins, or qualified class names "pkg.module:Class" / "pkg.module.Class",
  or classes) once at startup (`resolve_logits_processors`); a name nothing provides stops startup.
- The front end calls `cls.validate_params(params)` for every request before queuing it (a ValueError
  is the request's error, a 400 in the server); per-request arguments travel in
  `SamplingParams.extra_args` (the server's `vllm_xargs`), as in vLLM.
- Each worker builds one instance per class (`cls(config, device, is_pin_memory)`). Before every step
  that samples, the model runner calls `update_state(batch_update)` with what changed in the batch of
  sampling rows since the previous call (None: nothing), then `apply(logits)` on the device with
  `logits: [batch_size, vocab]` whose row i is the request at index i.

Indices are rows of that step's logits. A `BatchUpdate` is applied in vLLM's order: `removed` (those
indices are free), then `added` (state for a new request at an index), then `moved` (one-way moves
and swaps). `added` carries the request's prompt token ids and a live view of its output token ids
(it grows as tokens are committed; in a step it holds every token before the one being sampled).

Processors that cannot change a greedy request's token (`is_argmax_invariant()`) are applied after
temperature on the random path only, like vLLM's; the others before penalties, for every row. Raw
logprobs are those of the model (computed before any processor). Not with speculative decoding yet
(refused at startup).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from keel.engine.sampling_params import SamplingParams


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # the request at a goes to b; a is then free
    SWAP = auto()  # the requests at a and b trade places


RemovedRequest = int
# (index, params, prompt token ids, output token ids: a live view)
AddedRequest = tuple[int, "SamplingParams", Sequence[int], Sequence[int]]
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """What changed in the batch of sampling rows since the previous `update_state` call."""

    batch_size: int  # rows of the coming `apply`'s logits
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """Base class of `logits_processor` entries (vLLM's `LogitsProcessor`)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Called by the front end for every request; raise ValueError for arguments this processor
        refuses (e.g. a bad `extra_args` value)."""
        return None

    @abstractmethod
    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        """`config`: the engine's `EngineConfig`; `device`: where `apply` gets its logits."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [batch_size, vocab] float32 -> the processed logits (may be modified in place)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when the processor never changes which token is the largest (greedy requests skip it)."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every `apply`; None when the batch of sampling rows did not change."""


def resolve_logits_processors(entries: Sequence[str | type], plugin_set: Any) -> list[type[LogitsProcessor]]:
    """The classes `entries` name (registry key, "module:Class", "module.Class", or a class); a name
    that resolves to nothing, or to something that is not a LogitsProcessor, raises ValueError naming it."""
    registry = plugin_set.registry("logits_processor") if plugin_set is not None else None
    classes: list[type[LogitsProcessor]] = []
    for entry in entries:
        if isinstance(entry, str) and registry is not None and entry in registry:
            cls = registry.get(entry)
        elif isinstance(entry, str):
            cls = _import_qualified(entry, registry)
        else:
            cls = entry
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(f"logits_processors: {entry!r} is not a keel.logits_processor.LogitsProcessor subclass")
        classes.append(cls)
    return classes


def _import_qualified(name: str, registry: Any) -> Any:
    module, sep, attr = name.partition(":")
    if not sep:
        module, _, attr = name.rpartition(".")
    known = sorted(registry) if registry is not None else []
    if not module or not attr:
        raise ValueError(f"logits_processors: {name!r} is neither a logits_processor plugin key (known: {known}) "
                         "nor a qualified class name ('pkg.module:Class')")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"logits_processors: cannot import {name!r} ({exc}); logits_processor plugin keys: "
                         f"{known}") from None


@dataclass(frozen=True)
class LogitsProcessors:
    """A step's processors as the sampler applies them (set on `SamplingMetadata.logitsprocs`)."""

    non_argmax_invariant: tuple[LogitsProcessor, ...] = ()
    argmax_invariant: tuple[LogitsProcessor, ...] = ()


def process_dict_updates(entries: dict[int, Any], batch_update: BatchUpdate | None, new_state: Any) -> bool:
    """Apply `batch_update` to a processor's `{index: state}` (vLLM's helper of the same name).

    `new_state(params, prompt_token_ids, output_token_ids)` gives an added request's state, or None when
    the processor has nothing to do for it. Returns whether `entries` changed.
    """
    if batch_update is None:
        return False
    updated = False
    for index in batch_update.removed:
        updated |= entries.pop(index, None) is not None
    for index, params, prompt, output in batch_update.added:
        state = new_state(params, prompt, output)
        if state is not None:
            entries[index] = state
            updated = True
        else:
            updated |= entries.pop(index, None) is not None
    for a, b, direction in batch_update.moved:
        a_entry, b_entry = entries.pop(a, None), entries.pop(b, None)
        if a_entry is not None:
            entries[b] = a_entry
        if b_entry is not None and direction is MoveDirectionality.SWAP:
            entries[a] = b_entry
        updated |= a_entry is not None or b_entry is not None
    return updated
