"""`keel serve`: the OpenAI-compatible API server over an `AsyncLLM`.

    keel serve --model PATH [--profile P] [--host H] [--port N] [--api-key K] [--served-model-name NAME]
               [--dtype D] [engine args]

The core does not know the HTTP server: it is the `endpoint` registry entry "api_server" (plugin
keel-endpoints) of the loaded plugin set, called as `serve(engine_client, config, *, host, port, api_key, log_level)`.
"""

from __future__ import annotations

import argparse
import os

from keel.cli import add_engine_cli_args
from keel.config import ConfigError

API_SERVER_KEY = "api_server"


class ServeError(ConfigError):
    """`keel serve` cannot start (no model, no server plugin); the message says what to do. A ConfigError,
    so the CLI reports it without a traceback."""


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    group.add_argument("--api-key", default=os.environ.get("KEEL_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on the API routes (default: $KEEL_API_KEY)")
    group.add_argument("--uvicorn-log-level", default="info", help="uvicorn's log level")
    add_engine_cli_args(parser, "serve")


def run_serve(ns: argparse.Namespace) -> int:
    from keel.config import EngineArgs
    from keel.engine.async_llm import AsyncLLM

    args = EngineArgs.from_cli_args(ns)
    if args.model is None:
        raise ServeError("keel serve needs --model PATH (or 'demo' for the small local demo model)")
    engine = AsyncLLM.from_engine_args(args)
    try:
        endpoints = engine.config.plugin_set().registry("endpoint")
        if API_SERVER_KEY not in endpoints:
            loaded = ", ".join(engine.config.plugin_set().names)
            raise ServeError(
                f"no API server: no loaded plugin provides endpoint {API_SERVER_KEY!r}. Install keel-endpoints "
                f"and keel-io-processors and list 'endpoints' and 'io-processors' in the profile's plugins "
                f"(loaded: {loaded})"
            )
        server = endpoints.get(API_SERVER_KEY)
        status = server.serve(engine, engine.config, host=ns.host, port=ns.port, api_key=ns.api_key,
                              log_level=ns.uvicorn_log_level)
        return int(status or 0)
    finally:
        engine.shutdown()
