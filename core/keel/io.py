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


@dataclass(frozen=True)
class RequestLimits:
    """What one request may make an IO processor do. The API server builds it from its configuration
    and passes it to every `io_processor` factory as `limits=`. Frozen: fields are only ever added."""

    # Render a chat template sent in the request (vLLM's --trust-request-chat-template); else HTTP 400.
    trust_request_chat_template: bool = False
    # Budget of one chat-template rendering, the model's own template included.
    chat_template_timeout_s: float = 2.0
    chat_template_max_chars: int = 4 << 20


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

    # Optional: `request_schema() -> dict`, the JSON schema of the payload `parse_request` accepts; the
    # API server publishes it in /openapi.json.


def inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON schema with its local `$defs` references replaced by the definitions (pydantic's
    `model_json_schema()` output, made self-contained for an OpenAPI document). Definitions must not
    refer to themselves."""
    defs = schema.get("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return inline(schema)

