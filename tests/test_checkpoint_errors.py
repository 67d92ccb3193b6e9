"""A broken checkpoint stops startup with one line naming the file and what is wrong with it; a local path
that does not exist is reported as such. Offline (`LLM`), and from `keel generate` / `keel serve` without
a traceback."""

from __future__ import annotations

import os
import shutil

import pytest

from keel import LLM
from keel.cli import main
from keel.models.checkpoint_files import CheckpointError


def _truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt_safetensors(d) -> None:
    _truncate(d / "model.safetensors")


def _truncated_tokenizer(d) -> None:
    _truncate(d / "tokenizer.json")


def _config_not_json(d) -> None:
    (d / "config.json").write_text("{not json")


def _no_weights(d) -> None:
    for f in d.glob("*.safetensors"):
        f.unlink()


def _no_config(d) -> None:
    (d / "config.json").unlink()


# (break the checkpoint, the file the message names, what it says)
BROKEN = {
    "corrupt-safetensors": (_corrupt_safetensors, "model.safetensors", "not a valid safetensors file"),
    "truncated-tokenizer": (_truncated_tokenizer, "tokenizer.json", "not valid JSON"),
    "config-not-json": (_config_not_json, "config.json", "not valid JSON"),
    "no-config": (_no_config, "config.json", "missing"),
    "no-weights": (_no_weights, "", "no *.safetensors or *.bin weight files"),
}


@pytest.fixture(params=list(BROKEN))
def broken(request, tiny_model_dir, tmp_path):
    breaker, file, what = BROKEN[request.param]
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, d)
    breaker(d)
    return d, os.path.join(str(d), file) if file else str(d), what


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("keel: error: "), err
    return err[0]


def test_llm_names_the_file_and_the_problem(broken):
    d, file, what = broken
    with pytest.raises(Exception) as info:  # noqa: PT011 -- the type is checked below
        LLM(model=str(d), profile="cpu", max_model_len=32, num_kv_blocks=8)
    message = str(info.value)
    assert file in message and what in message and "\n" not in message, message


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_prints_one_line_and_no_traceback(broken, command, capsys):
    d, file, what = broken
    args = [command, "--model", str(d), "--profile", "cpu", "--max-model-len", "32", "--num-kv-blocks", "8"]
    assert main(args + (["--prompt", "hi"] if command == "generate" else [])) == 1
    line = _one_error_line(capsys)
    assert file in line and what in line, line


@pytest.mark.parametrize("model", ["./no/such/dir", "/no/such/checkpoint", "no/such/deep/path", "~/no-such-keel-dir"])
def test_a_missing_local_path_is_reported_as_missing(model, capsys):
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(model=model, profile="cpu")
    assert main(["generate", "--model", model, "--profile", "cpu", "--prompt", "hi"]) == 1
    line = _one_error_line(capsys)
    assert "does not exist" in line and "Repo id" not in line, line
