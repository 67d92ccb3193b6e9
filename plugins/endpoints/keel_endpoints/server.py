"""The API server: builds the FastAPI app from the selected endpoints and serves it with uvicorn.

`keel serve` finds `APIServer` as the `endpoint` registry entry "api_server" and calls `APIServer.serve`.
As an endpoint itself, it adds the server's own routes: /health, /ping, /version, /v1/models,
/v1/models/{id}, /tokenize, /detokenize, /tokenizer_info (with --enable-tokenizer-info-endpoint) and
/metrics; FastAPI serves /docs, /redoc and /openapi.json.
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from keel.endpoint import EndpointContext
from keel.io import RequestLimits
from keel.version import __version__
from keel_endpoints.errors import OpenAIError, install_error_handlers
from keel_endpoints.guard import RequestGuard
from keel_endpoints.options import ServerConfig
from keel_endpoints.preprocess import install_preprocess_pool
from keel_endpoints.utility import register_utility_routes

logger = logging.getLogger("keel.endpoints")

# Reachable without the API key: probes and scrapers carry no credentials.
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


class APIKeyMiddleware:
    """Pure ASGI (no response buffering, so streams and disconnects pass through untouched): every
    path but `PUBLIC_PATHS` needs `Authorization: Bearer <key>`, else 401. The scheme is
    case-insensitive (RFC 6750 / RFC 9110), the key is not."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
            error = OpenAIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'.",
                                code="invalid_api_key")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _io_processors(plugin_set: Any, engine_client: Any, served_model_name: str,
                   limits: RequestLimits, config: Any = None) -> tuple[tuple[str, Any], ...]:
    from keel.models.generation_config import default_sampling_overrides

    registry = plugin_set.registry("io_processor")
    model = getattr(config, "model", None)
    # The model's generation_config.json defaults (`--generation-config`), for fields requests leave unset.
    defaults = default_sampling_overrides(getattr(model, "generation_config_fields", None) or {})
    out = []
    for key in registry:
        factory = registry.get(key)
        out.append((key, factory(tokenizer=engine_client.get_tokenizer(), served_model_name=served_model_name,
                                 max_model_len=engine_client.max_model_len, limits=limits,
                                 plugin_set=plugin_set,
                                 plugin_options=dict(getattr(config, "plugin_options", None) or {}),
                                 default_sampling_params=defaults)))
    return tuple(out)


def build_app(engine_client: Any, config: Any, *, served_model_name: str | None = None,
              api_key: str | None = None, plugin_set: Any = None, server_config: ServerConfig | None = None) -> FastAPI:
    """The app with every `endpoint` of the plugin set registered (the server's own routes first).

    `plugin_set` defaults to `config.plugin_set()`: the profile decides which endpoint plugins exist.
    `server_config` defaults to the `keel serve` flags in `config.plugin_options`.
    """
    plugin_set = plugin_set if plugin_set is not None else config.plugin_set()
    if server_config is None:
        server_config = ServerConfig.from_plugin_options(getattr(config, "plugin_options", None))
    name = served_model_name or config.model.served_model_name
    app = FastAPI(title="keel", version=__version__, docs_url="/docs", redoc_url="/redoc")
    install_error_handlers(app)
    ctx = EndpointContext(engine_client=engine_client, config=config, served_model_name=name,
                          io_processors=_io_processors(plugin_set, engine_client, name,
                                                        server_config.request_limits, config))
    endpoints = plugin_set.registry("endpoint")
    keys = ["api_server", *(k for k in endpoints if k != "api_server")]
    for key in keys:
        endpoint = APIServer(server_config) if key == "api_server" else endpoints.get(key)
        if isinstance(endpoint, type):
            endpoint = endpoint()
        endpoint.register(app, ctx)
        logger.info("registered endpoint %r from %s", key, endpoints.provider(key) if key in endpoints else "?")
    install_preprocess_pool(app, server_config.preprocess_threads)
    app.add_middleware(RequestGuard, max_body_bytes=server_config.max_request_body_bytes)
    if api_key:  # added last: outermost, so nobody without the key gets a body read
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


class APIServer:
    """The "api_server" endpoint: the server's own routes, and the `serve` entry point of `keel serve`."""

    def __init__(self, server_config: ServerConfig | None = None) -> None:
        self.server_config = server_config or ServerConfig()

    def register(self, app: FastAPI, ctx: EndpointContext) -> None:
        engine = ctx.engine_client
        created = int(time.time())

        @app.get("/health")
        async def health() -> Response:
            try:
                await engine.check_health()
            except Exception as exc:  # noqa: BLE001 -- any failure means unhealthy
                return OpenAIError(503, f"the engine is not healthy: {exc}").response()
            return Response(status_code=200)

        @app.get("/ping")
        async def ping() -> Response:
            return await health()

        @app.get("/version")
        async def version() -> JSONResponse:
            return JSONResponse({"version": __version__})

        root = ctx.config.model.model if ctx.config is not None and ctx.config.model else None
        card = {"id": ctx.served_model_name, "object": "model", "created": created, "owned_by": "keel",
                "root": root, "parent": None, "max_model_len": engine.max_model_len}

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [card]})

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str) -> JSONResponse:
            if model_id != ctx.served_model_name:
                raise OpenAIError(404, f"The model `{model_id}` does not exist.", param="model",
                                  code="model_not_found")
            return JSONResponse(card)

        register_utility_routes(app, ctx, self.server_config)

    @staticmethod
    def serve(engine_client: Any, config: Any, *, host: str = "127.0.0.1", port: int = 8000,
              api_key: str | None = None, log_level: str = "info") -> int:
        """Called by `keel serve`: build the app and run uvicorn until interrupted; returns the exit status."""
        import uvicorn

        app = build_app(engine_client, config, api_key=api_key)
        logger.warning("keel API server on http://%s:%d (model %r)", host, port, config.model.served_model_name)
        uvicorn.run(app, host=host, port=port, log_level=log_level)
        return 0
