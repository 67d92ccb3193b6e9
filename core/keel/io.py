"""IOProcessor: turns an API request payload into engine prompts and engine outputs into a response.

Registered under the `io_processor` kind; runs in the API process only (never in workers). The
endpoint calls, per request: `parse_request` -> `pre_process` -> (engine) -> `post_process`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class EnginePrompt:
    """One prompt for the engine. Frozen: fields are only ever added (multimodal data, ...)."""

    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    extra: tuple[tuple[str, Any], ...] = field(default=())


@runtime_checkable
class IOProcessor(Protocol):
    def parse_request(self, payload: Any) -> Any:
        """Called by the endpoint with the decoded request body; validates it (ValueError with the
        field at fault) and returns the processor's own request object."""
        ...

    def pre_process(self, request: Any) -> Sequence[EnginePrompt]:
        """Called once per request before submission; may return several prompts (batch inputs)."""
        ...

    def post_process(self, request: Any, outputs: Sequence[Any]) -> Any:
        """Called once with the finished `RequestOutput`s (same order as pre_process's prompts);
        returns the response payload (JSON-serializable)."""
        ...
