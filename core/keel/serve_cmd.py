"""`keel serve`: the OpenAI-compatible API server over an `AsyncLLM`.

    keel serve MODEL [--profile P] [--host H] [--port N] [--api-key K] [--served-model-name NAME]
               [--chat-template FILE] [--dtype D] [engine args]       (--model MODEL works too)

Environment: $KEEL_API_KEY or $VLLM_API_KEY set --api-key's default.

The core does not know the HTTP server: it is the `endpoint` registry entry "api_server" (plugin
keel-endpoints) of the loaded plugin set, called as `serve(engine_client, config, *, host, port, api_key, log_level)`.
"""

from __future__ import annotations

import argparse
import os

from keel.cli import add_engine_cli_args
from keel.config import ConfigError

API_SERVER_KEY = "api_server"
API_KEY_ENV = ("KEEL_API_KEY", "VLLM_API_KEY")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class ServeError(ConfigError):
    """`keel serve` cannot start (no model, no server plugin); the message says what to do. A ConfigError,
    so the CLI reports it without a traceback."""


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    from keel.engine_args import AsyncEngineArgs

    parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                        help="model directory, Hugging Face repo id or 'demo', as `vllm serve MODEL` "
                             "(default: --model)")
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    api_key = next((os.environ[e] for e in API_KEY_ENV if os.environ.get(e)), None)
    group.add_argument("--api-key", default=api_key,
                       help="require 'Authorization: Bearer KEY' on the API routes (default: $KEEL_API_KEY, "
                            "else $VLLM_API_KEY, else none)")
    group.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS,
                       help="uvicorn's log level (default: info)")
    group.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                       help="chat template for /v1/chat/completions, a file or the Jinja text itself "
                            "(default: the tokenizer's)")
    add_engine_cli_args(parser, "serve", args_cls=AsyncEngineArgs)


def run_serve(ns: argparse.Namespace) -> int:
    from keel.chat_template import load_chat_template
    from keel.engine.async_llm import AsyncLLM
    from keel.engine_args import AsyncEngineArgs

    args = AsyncEngineArgs.from_cli_args(ns)
    if ns.model_tag is not None and args.model is not None and ns.model_tag != args.model:
        raise ServeError(f"two models given: {ns.model_tag!r} and --model {args.model!r}; give one")
    args.model = ns.model_tag or args.model
    if args.model is None:
        raise ServeError("keel serve needs a model: keel serve PATH (or 'demo' for the small local demo model)")
    template = load_chat_template(ns.chat_template) if ns.chat_template is not None else None
    engine = AsyncLLM.from_engine_args(args)
    try:
        if template is not None:
            if engine.tokenizer is None:
                raise ServeError("--chat-template needs a tokenizer (--skip-tokenizer-init is set)")
            engine.tokenizer.chat_template = template
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
