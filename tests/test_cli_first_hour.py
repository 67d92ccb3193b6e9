"""The first hour with the `keel` command, as a new user meets it: every user error is one line naming
the problem with a non-zero exit, never a traceback; logprobs print; the demo says its weights are random;
sampling flags left out take the model's generation_config."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from keel import cli, generate_cmd

TINY = ["--max-model-len", "64", "--num-kv-blocks", "16", "--platform", "cpu"]


def one_error_line(capsys, argv, code=1) -> str:
    assert cli.main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("keel"), err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("flag,value,field", [("--temperature", "-1", "temperature"), ("--top-p", "2", "top_p"),
                                              ("--n", "0", "n"), ("--max-tokens", "0", "max_tokens")])
def test_bad_sampling_value_is_one_line_before_the_model_loads(capsys, monkeypatch, flag, value, field):
    import keel.engine.llm

    monkeypatch.setattr(keel.engine.llm, "LLM", None)  # never reached: the value is checked first
    err = one_error_line(capsys, ["generate", "--model", "unused", "--prompt", "x", flag, value])
    assert field in err


def _copy(src: str, dst: Path, drop: tuple[str, ...]) -> str:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*drop))
    return str(dst)


@pytest.mark.parametrize("drop,expected", [
    (("config.json",), "config.json: missing"),
    (("*.safetensors",), "no *.safetensors or *.bin weight files"),
    (("tokenizer*", "special_tokens_map.json"), "has no tokenizer"),
])
def test_incomplete_checkpoint_folder_is_one_line(capsys, tmp_path, tiny_model_dir, drop, expected):
    path = _copy(tiny_model_dir, tmp_path / "m", drop)
    err = one_error_line(capsys, ["generate", "--model", path, "--prompt", "x", *TINY])
    assert expected in err


def test_missing_path_is_one_line(capsys, tmp_path):
    err = one_error_line(capsys, ["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"])
    assert "does not exist" in err


def test_bad_flag_value_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--model", "m", "--prompt", "x", "--max-tokens", "many"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--max-tokens" in err


def test_ctrl_c_is_one_line(capsys, monkeypatch):
    def interrupted(ns):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate_cmd, "run_generate", interrupted)
    assert one_error_line(capsys, ["generate", "--model", "m", "--prompt", "x"], code=130) == "keel: interrupted"


def test_closed_pipe_is_one_line(tiny_model_dir):
    """`keel generate ... | head -1` with the reader gone before keel writes."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "keel.cli", "generate", "--model", tiny_model_dir, "--prompt", "a", "--prompt", "b",
         "--max-tokens", "2", *TINY], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"})
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141
    lines = [ln for ln in err.splitlines() if ln.startswith("keel")]
    assert lines == ["keel: error: output closed before everything was written (broken pipe)"], err
    assert "Traceback" not in err


def test_generate_prints_logprobs(capsys, tiny_model_dir):
    assert cli.main(["generate", "--model", tiny_model_dir, "--prompt", "hello", "--max-tokens", "3",
                     "--temperature", "0", "--logprobs", "2", *TINY]) == 0
    lines = capsys.readouterr().out.splitlines()
    token_lines = [ln for ln in lines if " rank " in ln]
    assert len(token_lines) == 3 and all("rank 1" in ln and ln.count("|") == 1 for ln in token_lines)
    assert cli.main(["generate", "--model", tiny_model_dir, "--prompt", "hello", "--max-tokens", "3",
                     "--temperature", "0", "--logprobs", "2", "--json", *TINY]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert len(row["logprobs"]) == 3 and all(len(t["top"]) >= 2 and t["rank"] == 1 for t in row["logprobs"])


def test_sampling_defaults_come_from_generation_config(capsys, tmp_path, tiny_model_dir):
    path = _copy(tiny_model_dir, tmp_path / "m", ())
    (Path(path) / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "temperature": 0.0}))
    assert cli.main(["generate", "--model", path, "--prompt", "hello", "--ignore-eos", "--json", *TINY]) == 0
    assert len(json.loads(capsys.readouterr().out.splitlines()[-1])["token_ids"]) == 3
    assert cli.main(["generate", "--model", path, "--prompt", "hello", "--ignore-eos", "--json", "--max-tokens",
                     "5", *TINY]) == 0
    assert len(json.loads(capsys.readouterr().out.splitlines()[-1])["token_ids"]) == 5


def test_server_only_flag_in_generate_is_an_error(capsys):
    err = one_error_line(capsys, ["generate", "--model", "m", "--prompt", "x", "--engine-core-process"])
    assert "--engine-core-process" in err and "keel serve" in err


def test_demo_says_its_weights_are_random(monkeypatch, tmp_path, caplog):
    import keel.demo
    from keel.config import EngineArgs
    from keel.engine.llm_engine import resolve_model_shortcut

    monkeypatch.setattr(keel.demo, "build_demo_checkpoint", lambda path: tmp_path)
    args = EngineArgs(model="demo")
    with caplog.at_level(logging.WARNING, logger="keel.engine"):
        resolve_model_shortcut(args)
    assert args.model == str(tmp_path) and "random weights" in caplog.text


def test_chat_without_a_template_is_one_line(capsys, tmp_path, tiny_model_dir):
    path = _copy(tiny_model_dir, tmp_path / "m", ())
    config_file = Path(path) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    (Path(path) / "chat_template.jinja").unlink(missing_ok=True)
    err = one_error_line(capsys, ["generate", "--model", path, "--prompt", "x", "--chat", *TINY])
    assert "no chat template" in err and "--chat-template" in err
    assert cli.main(["generate", "--model", path, "--prompt", "x", "--chat", "--max-tokens", "2",
                     "--chat-template", "{% for m in messages %}{{ m.content }}{% endfor %}", *TINY]) == 0
