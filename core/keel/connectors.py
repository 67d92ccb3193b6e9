"""KV connector: moves KV cache blocks between this engine and something external (another instance,
CPU/disk tier, a remote store). Two sides, created from one registered class (`kv_connector` kind):

- scheduler side (`KVConnectorScheduler`), in the engine core: how many tokens of a request already
  exist externally, what to load/save this step (carried to workers as `KVConnectorMetadata`);
- worker side (`KVConnectorWorker`), in each worker: starts loads before the forward pass, waits per
  layer, saves per layer, and reports finished asynchronous transfers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Protocol, runtime_checkable


class KVConnectorRole(Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(frozen=True)
class KVConnectorRequest:
    """A request as the scheduler side sees it. Frozen: fields are only ever added.

    `num_tentative_tokens` counts speculative tokens whose KV must never be saved externally.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    num_computed_tokens: int
    block_ids: tuple[tuple[int, ...], ...] = ()  # per KV cache group
    num_tentative_tokens: int = 0
    extra: tuple[tuple[str, Any], ...] = field(default=())


@dataclass(frozen=True)
class KVConnectorMetadata:
    """Built by the scheduler side each step, handed unchanged to every worker side."""

    payload: Any = None


@runtime_checkable
class KVConnectorScheduler(Protocol):
    def get_num_new_matched_tokens(self, request: KVConnectorRequest) -> tuple[int, bool]:
        """Called by the scheduler when it considers a waiting request: tokens beyond
        `num_computed_tokens` available externally, and whether they load asynchronously."""
        ...

    def update_state_after_alloc(self, request: KVConnectorRequest, num_external_tokens: int) -> None:
        """Called after blocks for the request were allocated (block ids are in `request`)."""
        ...

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Called once per step at the end of `schedule()`; must reset its per-step state."""
        ...

    def request_finished(self, request: KVConnectorRequest) -> tuple[bool, dict[str, Any] | None]:
        """Called when a request finishes: (keep its blocks until an async save completes,
        transfer parameters to return to the client)."""
        ...


@runtime_checkable
class KVConnectorWorker(Protocol):
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Called once after the worker allocates its KV cache tensors (layer name -> tensor)."""
        ...

    def start_load_kv(self, metadata: KVConnectorMetadata, forward_context: Any) -> None:
        """Called before the forward pass each step; starts (possibly async) loads."""
        ...

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Called by each attention layer before it reads its cache."""
        ...

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        """Called by each attention layer after it wrote its new KV (may start an async save)."""
        ...

    def wait_for_save(self) -> None:
        """Called after the forward pass; blocks until this step's saves may be overwritten."""
        ...

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Called after each step: (request ids whose sends finished, whose receives finished)."""
        ...


class KVConnectorBase(Protocol):
    """The registered class: builds one side for the given role."""

    name: ClassVar[str]

    @classmethod
    def create(cls, role: KVConnectorRole, config: Any) -> KVConnectorScheduler | KVConnectorWorker:
        """Called once per process (engine core: SCHEDULER; each worker: WORKER) at startup."""
        ...
