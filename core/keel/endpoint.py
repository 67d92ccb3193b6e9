"""Endpoint: a plugin that adds HTTP routes to the API server.

Registered under the `endpoint` kind. The API server (endpoints plugin) builds the app, then calls
`register(app, ctx)` once per selected endpoint before serving; routes reach the engine only
through `ctx.engine_client`, so the engine core may live in another process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class EndpointContext:
    """What an endpoint may use. Frozen: fields are only ever added."""

    engine_client: Any  # AsyncLLM-like: generate(), abort(), get_tokenizer(), ...
    config: Any  # the EngineConfig
    served_model_name: str
    io_processors: tuple[tuple[str, Any], ...] = field(default=())  # key -> IOProcessor instance


@runtime_checkable
class Endpoint(Protocol):
    def register(self, app: Any, ctx: EndpointContext) -> None:
        """Called once at server start with the web app (FastAPI); adds routes, never serves."""
        ...
