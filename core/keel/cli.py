"""The `keel` command. Subcommands are registered, so other modules add theirs without editing this file.

    register_command("bench", add_bench_args, run_bench, help="offline benchmarks")

`add_parser_fn(parser)` fills the subcommand's parser (call `add_engine_cli_args(parser, name)` there
to get the engine flags plus options plugins add through the `keel_add_cli_options` hook);
`run_fn(namespace)` returns the exit status. Either may be a lazy "module:attr" string, so heavy
modules are imported only when their subcommand runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

AddParserFn = Callable[[argparse.ArgumentParser], None]
RunFn = Callable[[argparse.Namespace], int | None]


@dataclass(frozen=True)
class Command:
    name: str
    add_parser: AddParserFn | str
    run: RunFn | str
    help: str = ""


_COMMANDS: dict[str, Command] = {}
# Set by `main` for the duration of one invocation, so `add_engine_cli_args` can see --profile/--plugins.
_argv: list[str] = []
# Parsers that got engine flags in this invocation: vLLM's unimplemented flags are refused on them last.
_engine_parsers: list[argparse.ArgumentParser] = []
# `--log-level`'s default, as vLLM's VLLM_LOGGING_LEVEL (KEEL_ first).
LOG_LEVEL_ENV = ("KEEL_LOGGING_LEVEL", "VLLM_LOGGING_LEVEL")


class KeelArgumentParser(argparse.ArgumentParser):
    """A usage error is one line naming the problem (argparse prints the whole usage block first)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def register_command(
    name: str, add_parser_fn: AddParserFn | str, run_fn: RunFn | str, help: str = ""
) -> None:
    """Add subcommand `name`. Registering the same name with different functions is an error."""
    command = Command(name, add_parser_fn, run_fn, help)
    existing = _COMMANDS.get(name)
    if existing is not None and existing != command:
        raise ValueError(f"keel subcommand {name!r} is already registered ({existing.run!r})")
    _COMMANDS[name] = command


def _resolve(fn: Any) -> Any:
    if isinstance(fn, str):
        from keel.plugins.registry import import_ref

        return import_ref(fn)
    return fn


def _preparse_plugins(argv: Sequence[str]) -> tuple[str | None, str | None]:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--profile")
    pre.add_argument("--plugins")
    ns, _ = pre.parse_known_args(list(argv))
    return ns.profile, ns.plugins


def add_engine_cli_args(parser: argparse.ArgumentParser, command: str, profile: str | None = None,
                        args_cls: Any = None) -> None:
    """Engine flags (`args_cls.add_cli_args`, default EngineArgs) plus the options of the plugins this run
    will load. vLLM flags keel does not implement become errors once the command has added its own.

    The plugins are those of `--plugins`, else of `--profile` (or `profile`), else every discovered one.
    """
    from keel.config import EngineArgs
    from keel.plugins.loader import load_plugins
    from keel.profile import load_profile

    (args_cls or EngineArgs).add_cli_args(parser)
    _engine_parsers.append(parser)
    flag_profile, flag_plugins = _preparse_plugins(_argv)
    profile = flag_profile or profile
    if flag_plugins:
        names: Any = "auto" if flag_plugins == "auto" else [p for p in flag_plugins.split(",") if p]
    else:
        names = load_profile(profile).plugins if profile else "auto"
    plugin_set = load_plugins(names if names == "auto" else list(names))
    before = {a.dest for a in parser._actions}
    plugin_set.hooks.hook.keel_add_cli_options(parser=parser, command=command)
    added = tuple(a.dest for a in parser._actions if a.dest not in before)
    parser.set_defaults(_keel_plugin_option_dests=added)


# -- keel plugins list ---------------------------------------------------------------------------------


def _plugins_add(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="plugins_cmd", required=True)
    ls = sub.add_parser("list", help="every discovered plugin, what it provides and its load status")
    ls.add_argument("--json", action="store_true", help="machine-readable output (default: off)")


def _plugins_run(ns: argparse.Namespace) -> int:
    from keel.plugins.discovery import discover

    rows = []
    for p in discover():
        provides = {k: sorted(v) for k, v in p.manifest.provides.items()} if p.manifest else {}
        rows.append({
            "name": p.name,
            "distribution": p.distribution,
            "version": p.version,
            "core_api": p.manifest.core_api if p.manifest else None,
            "provides": provides,
            "status": "ok" if p.ok else "error",
            "error": p.error,
        })
    if ns.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        status = "ok" if r["status"] == "ok" else f"ERROR: {r['error']}"
        print(f"{r['name']}  [{r['distribution']} {r['version'] or '?'}]  {status}")
        for kind, keys in r["provides"].items():
            print(f"    {kind}: {', '.join(keys)}")
    return 0


# -- keel profile show ---------------------------------------------------------------------------------


def _profile_add(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="profile_cmd", required=True)
    show = sub.add_parser("show", help="print the effective, validated configuration of a profile")
    show.add_argument("profile_name", metavar="PROFILE", help="profile name (profiles/NAME.yaml) or path (default: required)")
    show.add_argument("--json", action="store_true", help="machine-readable output (default: off)")
    after = _argv[_argv.index("show") + 1:] if "show" in _argv else []
    positional = [a for a in after if not a.startswith("-")]
    add_engine_cli_args(show, "profile show", profile=positional[0] if positional else None)


def _profile_run(ns: argparse.Namespace) -> int:
    import yaml

    from keel.config import EngineArgs

    args = EngineArgs.from_cli_args(ns)
    args.profile = args.profile or ns.profile_name
    _, sources, profile = args.resolve()
    config = args.create_engine_config(require_model=False)
    platform = config.platform()
    provider = config.plugin_set().registry("platform").provider(platform.name)
    out = {
        "profile": {"name": profile.name, "path": profile.path, "description": profile.description},
        "platform_selected": {"name": platform.name, "device_type": platform.device_type,
                              "provider": str(provider)},
        **config.to_dict(),
        "set_by": {k: v for k, v in sources.items() if v != "default"},
    }
    if ns.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        print(yaml.safe_dump(out, sort_keys=False, default_flow_style=False).rstrip())
    return 0


register_command("plugins", _plugins_add, _plugins_run, help="inspect installed plugins")
register_command("profile", _profile_add, _profile_run, help="inspect profiles")
# Commands of other core modules, lazily: their modules (and torch) load only when they run.
register_command("generate", "keel.generate_cmd:add_generate_args", "keel.generate_cmd:run_generate",
                 help="generate completions for prompts (offline)")
register_command("bench", "keel.bench:add_bench_args", "keel.bench:run_bench",
                 help="offline throughput and latency benchmarks")
register_command("serve", "keel.serve_cmd:add_serve_args", "keel.serve_cmd:run_serve",
                 help="OpenAI-compatible API server")


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The full parser; only the invoked subcommand's `add_parser_fn` runs (keeps startup light)."""
    from keel.vllm_flags import refuse_unimplemented_vllm_flags
    from keel.version import __version__

    parser = KeelArgumentParser(prog="keel", description="keel: LLM inference and serving")
    level = next((os.environ[e] for e in LOG_LEVEL_ENV if os.environ.get(e)), "WARNING")
    parser.add_argument("--log-level", default=level, type=_log_level,
                        help=f"logging level: DEBUG, INFO, WARNING, ERROR (default: {level}; "
                             f"${LOG_LEVEL_ENV[0]} or ${LOG_LEVEL_ENV[1]} set it)")
    parser.add_argument("--version", action="version", version=f"keel {__version__}",
                        help="print keel's version and exit (default: off)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if a in _COMMANDS), None)
    _engine_parsers.clear()
    for name, command in _COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        p.set_defaults(_keel_command=name)
        if name == chosen:
            _resolve(command.add_parser)(p)
    for p in _engine_parsers:
        refuse_unimplemented_vllm_flags(p)
    return parser


# User-facing error types, by module: matched only if that module was imported (no import cost here).
_USER_ERRORS = {
    "keel.plugins.errors": ("PluginError",),
    "keel.profile": ("ProfileError",),
    "keel.config": ("ConfigError",),
    "keel.models.registry": ("UnsupportedArchitectureError",),
    "keel.quantization": ("QuantizationError",),
    "keel.models.weights": ("WeightLoadError",),
    "keel.engine.engine_client": ("EngineDeadError",),  # e.g. the engine core process failed to start
    "keel.engine.limits": ("ParamError",),  # a sampling value out of range (keel generate --temperature -1)
    "keel.worker.worker": ("KVCacheSizeError",),
    "keel.demo": ("DemoCheckpointError",),
}


def _is_user_error(exc: BaseException) -> bool:
    for module_name, names in _USER_ERRORS.items():
        module = sys.modules.get(module_name)
        if module is not None and isinstance(exc, tuple(getattr(module, n) for n in names)):
            return True
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `keel` console script; returns the exit status."""
    global _argv
    _argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(_argv)
        ns = parser.parse_args(_argv)
        logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
        status = _resolve(_COMMANDS[ns._keel_command].run)(ns)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
    except KeyboardInterrupt:
        print("keel: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `keel generate ... | head -1`: the reader left. Later flushes of stdout must not raise again.
        with contextlib.suppress(OSError, ValueError):  # stdout without a file descriptor (captured)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print("keel: error: output closed before everything was written (broken pipe)", file=sys.stderr)
        return 141
    except Exception as exc:
        if not _is_user_error(exc):
            raise
        print(f"keel: error: {_one_line(str(exc))}", file=sys.stderr)
        return 1
    return int(status or 0)


def _log_level(text: str) -> str:
    if text.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise argparse.ArgumentTypeError(f"{text!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    return text.upper()


def _one_line(message: str) -> str:
    return " ".join(message.split())


if __name__ == "__main__":
    # `python -m keel.cli`: run the canonical module so commands registered on `keel.cli` are seen.
    from keel.cli import main as _main

    sys.exit(_main())
