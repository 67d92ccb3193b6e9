"""The API server's own configuration section and the `keel serve` flags that set it.

The flags are added through the `keel_add_cli_options` hook (the core knows nothing of HTTP); their
values reach the server in `EngineConfig.plugin_options`, and `ServerConfig.from_plugin_options`
turns them into this typed, validated section.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from keel.io import RequestLimits
from keel.plugins.hookspecs import hookimpl

MiB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    """Read by `build_app`; every field (and every field of `request_limits`) has a `keel serve` flag of
    the same name."""

    # A larger body is refused with 413 before it is read (Content-Length) or as soon as it grows past.
    max_request_body_bytes: int = 16 * MiB
    # Threads that parse, render and tokenize request bodies: a long tokenization or a template at
    # its time budget holds one of them, never the engine's shared tokenizer thread.
    preprocess_threads: int = 4
    # What IO processors may spend on one request (chat templates), handed to each of them.
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    # /metrics names: "keel:..." or vLLM's own "vllm:..." (dashboards built for vLLM then work unchanged).
    metrics_prefix: str = "keel"
    # GET /tokenizer_info (vLLM's --enable-tokenizer-info-endpoint): off by default, as it shows the template.
    enable_tokenizer_info_endpoint: bool = False

    def __post_init__(self) -> None:
        from keel_endpoints.prometheus import PREFIXES

        if self.metrics_prefix not in PREFIXES:
            raise ValueError(f"metrics_prefix must be one of {', '.join(PREFIXES)}, got {self.metrics_prefix!r}")
        limits = self.request_limits
        for name, value in (("max_request_body_bytes", self.max_request_body_bytes),
                            ("preprocess_threads", self.preprocess_threads),
                            ("chat_template_max_chars", limits.chat_template_max_chars)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        timeout = limits.chat_template_timeout_s
        if not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"chat_template_timeout_s must be a positive number, got {timeout!r}")

    @classmethod
    def from_plugin_options(cls, options: Mapping[str, Any] | None) -> ServerConfig:
        """The section from the parsed flags (unset flags keep the defaults)."""
        given = {k: v for k, v in (options or {}).items() if v is not None}
        limits = {f.name: given[f.name] for f in dataclasses.fields(RequestLimits) if f.name in given}
        own = {f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given}
        return cls(**own, request_limits=RequestLimits(**limits))


def _size(text: str) -> int:
    from keel.engine_args import parse_size

    try:
        return int(parse_size(text))
    except Exception as exc:  # noqa: BLE001 -- argparse reports it as a bad flag value
        raise argparse.ArgumentTypeError(str(exc)) from None


class Hooks:
    @hookimpl
    def keel_add_cli_options(self, parser: argparse.ArgumentParser, command: str) -> None:
        if command != "serve":
            return
        group = parser.add_argument_group("API server (plugin endpoints)")
        group.add_argument("--max-request-body-bytes", type=_size, default=None, metavar="BYTES",
                           help="refuse larger request bodies with 413 (default 16MiB; suffixes KiB, MiB, ...)")
        group.add_argument("--preprocess-threads", type=int, default=None, metavar="N",
                           help="threads rendering and tokenizing requests, apart from the engine's (default 4)")
        group.add_argument("--trust-request-chat-template", action="store_true", default=None,
                           help="render a `chat_template` sent in a chat request (default: refused with 400)")
        group.add_argument("--chat-template-timeout-s", type=float, default=None, metavar="SECONDS",
                           help="time budget of one chat-template rendering (default 2)")
        group.add_argument("--enable-tokenizer-info-endpoint", action="store_true", default=None,
                           help="serve GET /tokenizer_info (the tokenizer's settings and chat template; default: off)")
        group.add_argument("--metrics-prefix", choices=("keel", "vllm"), default=None,
                           help="prefix of the /metrics names: keel (default) or vllm, for dashboards built for vLLM")
        group.add_argument("--chat-template-max-chars", type=int, default=None, metavar="N",
                           help="size budget of one rendered chat template, in characters (default 4Mi)")


hooks = Hooks()
