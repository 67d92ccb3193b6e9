import json
import os
import subprocess
import sys

import pytest

from keel import cli

HOOKS = """
from keel.plugins.hookspecs import hookimpl


class Impl:
    @hookimpl
    def keel_add_cli_options(self, parser, command):
        parser.add_argument("--npu-cores", type=int, default=1)

    @hookimpl
    def keel_adjust_config(self, config):
        cores = config.plugin_options.get("npu_cores", 1)
        return {"scheduler": {"max_num_seqs": cores}}


impl = Impl()
"""


def test_plugins_list_shows_broken_plugin_and_succeeds(fake_plugins, capsys):
    fake_plugins("broken-thing", body="raise ImportError('libfoo missing')", dist="keel-broken-thing")
    fake_plugins("fine", provides={"endpoint": {"hello": "PKG:X"}})
    assert cli.main(["plugins", "list"]) == 0
    out = capsys.readouterr().out
    assert "broken-thing  [keel-broken-thing 1.2.3]  ERROR: ImportError: libfoo missing" in out
    assert "fine" in out and "endpoint: hello" in out and "platform-cpu" in out


def test_plugins_list_json(fake_plugins, capsys):
    fake_plugins("broken-json", body="raise ImportError('nope')")
    assert cli.main(["plugins", "list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["broken-json"]["status"] == "error" and "nope" in rows["broken-json"]["error"]
    assert rows["platform-cpu"]["provides"] == {"platform": ["cpu"]} and rows["core"]["status"] == "ok"


def test_profile_show_prints_effective_config(tmp_path, capsys):
    prof = tmp_path / "mine.yaml"
    prof.write_text("plugins: [platform-cpu]\nplatform: cpu\nengine: {block_size: 32, max_num_seqs: 8}\n")
    assert cli.main(["profile", "show", str(prof), "--max-num-seqs", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["platform_selected"]["name"] == "cpu" and out["plugins"] == ["core", "platform-cpu"]
    assert out["cache"]["block_size"] == 32 and out["scheduler"]["max_num_seqs"] == 4
    assert out["set_by"] == {"plugins": "profile", "platform": "profile", "block_size": "profile",
                             "max_num_seqs": "args"}
    assert cli.main(["profile", "show", str(prof)]) == 0
    assert "block_size: 32" in capsys.readouterr().out


def test_profile_show_unknown_key_fails(tmp_path, capsys):
    prof = tmp_path / "typo.yaml"
    prof.write_text("plugins: [platform-cpu]\nengine: {max_num_seq: 8}\n")
    assert cli.main(["profile", "show", str(prof)]) == 1
    err = capsys.readouterr().err
    assert "'max_num_seq'" in err and "did you mean 'max_num_seqs'" in err


def test_plugin_cli_options_reach_config(fake_plugins, tmp_path, capsys):
    fake_plugins("npu-tuner", hooks=("PKG.hooks:impl",), files={"hooks.py": HOOKS})
    prof = tmp_path / "npu.yaml"
    prof.write_text("plugins: [platform-cpu, npu-tuner]\n")
    assert cli.main(["profile", "show", str(prof), "--npu-cores", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plugin_options"] == {"npu_cores": 6} and out["scheduler"]["max_num_seqs"] == 6


def test_register_command(capsys):
    seen = {}

    def add(parser):
        parser.add_argument("--times", type=int, default=1)

    def run(ns):
        seen["times"] = ns.times
        return 3

    cli.register_command("echo-test", add, run, help="test command")
    try:
        assert cli.main(["echo-test", "--times", "2"]) == 3 and seen == {"times": 2}
        with pytest.raises(ValueError, match="already registered"):
            cli.register_command("echo-test", add, lambda ns: 0)
    finally:
        cli._COMMANDS.pop("echo-test")


def _run_keel(args, pythonpath):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([pythonpath, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "keel.cli", *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("case", ["missing", "import_error", "incompatible"])
def test_named_plugin_failure_exits_nonzero(fake_plugins, tmp_path, case):
    if case == "missing":
        name, dist, cause = "platform-nowhere", "<not installed>", "not installed"
    elif case == "import_error":
        name, dist, cause = "platform-crash", "keel-platform-crash", "RuntimeError: firmware too old"
        fake_plugins(name, dist=dist, body="raise RuntimeError('firmware too old')")
    else:
        name, dist, cause = "platform-v2", "keel-platform-v2", "incompatible core API"
        fake_plugins(name, dist=dist, core_api=">=2,<3")
    prof = tmp_path / "p.yaml"
    prof.write_text(f"plugins: [platform-cpu, {name}]\n")
    result = _run_keel(["profile", "show", str(prof)], fake_plugins.path)
    assert result.returncode == 1, result.stderr
    assert f"plugin '{name}' (distribution {dist})" in result.stderr and cause in result.stderr


def test_unnamed_broken_plugin_stops_nothing(fake_plugins, tmp_path):
    fake_plugins("unrelated", body="raise RuntimeError('broken but unused')")
    prof = tmp_path / "p.yaml"
    prof.write_text("plugins: [platform-cpu]\n")
    result = _run_keel(["profile", "show", str(prof)], fake_plugins.path)
    assert result.returncode == 0, result.stderr


def test_core_commands_registered_lazily():
    assert {"plugins", "profile", "generate", "bench"} <= set(cli._COMMANDS)
    assert isinstance(cli._COMMANDS["generate"].run, str)  # imported only when `keel generate` runs
