"""`keel serve MODEL` and vLLM's common flags: names, value syntax, env equivalents; a vLLM flag keel
does not implement is an error naming it; every flag of every subcommand has help text with its default."""

from __future__ import annotations

import argparse

import pytest

from keel import cli
from keel.chat_template import load_chat_template
from keel.config import ConfigError
from keel.engine_args import AsyncEngineArgs, EngineArgs, human_readable_int
from keel.engine_args_help import HELP


def parse(*argv):
    argv = list(argv)
    return cli.build_parser(argv).parse_args(argv)


def usage_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err  # one line, no usage block
    return err


def test_serve_takes_the_model_positionally_or_by_flag():
    assert parse("serve", "some/model").model_tag == "some/model"
    ns = parse("serve", "--port", "9", "m", "--max-model-len", "8k")
    assert (ns.model_tag, ns.port, ns.max_model_len) == ("m", 9, 8000)
    assert parse("serve", "--model", "m").model == "m"


def test_serve_two_different_models_is_an_error(capsys):
    assert cli.main(["serve", "a", "--model", "b"]) == 1
    assert "two models given" in capsys.readouterr().err


@pytest.mark.parametrize("text,value", [("4096", 4096), ("8k", 8000), ("8K", 8192), ("25.6k", 25600),
                                        ("1m", 10**6), ("1M", 2**20), ("2g", 2 * 10**9)])
def test_human_readable_int(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["1.5K", "eight", "8kb", ""])
def test_human_readable_int_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int(text)


def test_vllm_spellings_map_one_to_one():
    ns = parse("serve", "m", "-tp", "2", "-pp", "2", "-q", "fp8", "--kv-cache-dtype", "fp8",
               "--no-enable-prefix-caching", "--num-gpu-blocks-override", "64", "--generation-config", "vllm",
               "--served-model-name", "alias", "--seed", "3", "--dtype", "half", "--gpu-memory-utilization", "0.5",
               "--max-num-seqs", "7", "--max-num-batched-tokens", "99", "--enforce-eager", "--max-logprobs", "5",
               "--disable-log-stats", "--disable-log-requests", "--chat-template", "{{ messages }}",
               "--uvicorn-log-level", "debug", "--host", "0.0.0.0", "--port", "1", "--api-key", "k")
    args = AsyncEngineArgs.from_cli_args(ns)
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.quantization, args.kv_cache_dtype) == (
        2, 2, "fp8", "fp8")
    assert (args.enable_prefix_caching, args.num_kv_blocks, args.generation_config, args.served_model_name) == (
        False, 64, "vllm", "alias")
    assert (args.seed, args.dtype, args.gpu_memory_utilization, args.max_num_seqs) == (3, "half", 0.5, 7)
    assert (args.max_num_batched_tokens, args.enforce_eager, args.max_logprobs) == (99, True, 5)
    assert (args.disable_log_stats, args.enable_log_requests) == (True, False)
    assert (ns.chat_template, ns.uvicorn_log_level, ns.host, ns.port, ns.api_key) == (
        "{{ messages }}", "debug", "0.0.0.0", 1, "k")
    assert parse("serve", "m", "--enable-log-requests").enable_log_requests is True


def test_served_model_name_takes_one_name(capsys):
    assert "one name" in usage_error(capsys, "serve", "m", "--served-model-name", "a", "b")


@pytest.mark.parametrize("flag", ["--swap-space", "--enable-lora", "--cpu-offload-gb"])
def test_unimplemented_vllm_flag_is_an_error_naming_it(capsys, flag):
    err = usage_error(capsys, "serve", "m", flag, "4")
    assert f"{flag} is a vLLM flag keel does not implement" in err


def test_refused_flags_never_shadow_implemented_ones():
    # a flag keel (or a plugin) implements is parsed, not refused, whatever the table says
    from keel.vllm_flags import UNIMPLEMENTED

    parser = cli.build_parser(["serve"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    implemented = {s for a in sub._actions if a.help != argparse.SUPPRESS for s in a.option_strings}
    assert not implemented & set(UNIMPLEMENTED)


def test_api_key_from_keel_or_vllm_env(monkeypatch):
    monkeypatch.delenv("KEEL_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert parse("serve", "m").api_key == "from-vllm"
    monkeypatch.setenv("KEEL_API_KEY", "from-keel")
    assert parse("serve", "m").api_key == "from-keel"
    assert parse("serve", "m", "--api-key", "flag").api_key == "flag"


def test_log_level_from_env(monkeypatch):
    monkeypatch.delenv("KEEL_LOGGING_LEVEL", raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "info")
    assert parse("plugins", "list").log_level == "INFO"


def test_chat_template_file_or_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert load_chat_template(str(path)) == path.read_text()
    assert load_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ConfigError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_every_engine_field_has_help():
    assert set(AsyncEngineArgs.field_names()) <= set(HELP)
    assert set(EngineArgs.field_names()) <= set(HELP)


def _walk(parser: argparse.ArgumentParser, path: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _walk(child, f"{path} {name}")
        elif action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
            yield path, action


@pytest.mark.parametrize("command", [*cli._COMMANDS])
def test_help_text_and_default_for_every_flag_of_every_subcommand(command):
    """Each subcommand's parser is built as `keel COMMAND --help` builds it (plugins' options included)."""
    parser = cli.build_parser([command])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    missing = [f"{path}: {a.option_strings or a.dest}" for path, a in _walk(sub, f"keel {command}")
               if not a.help or "default" not in a.help.lower()]
    assert not missing, missing
    top = [a for _, a in _walk(parser, "keel") if a.option_strings]
    assert all(a.help and "default" in a.help for a in top)
