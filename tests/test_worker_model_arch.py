"""The worker resolves the checkpoint's architecture through the model registry: an unserved one is a
typed error naming the checkpoint, with a did-you-mean hint."""

from __future__ import annotations

import json

import pytest

from keel import LLM
from keel.models.registry import UnsupportedArchitectureError
from keel.testing.checkpoints import make_checkpoint


def _with_architectures(path, archs):
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = archs
    (path / "config.json").write_text(json.dumps(config))


def test_unserved_architecture_names_model_and_suggests(tmp_path):
    make_checkpoint("llama", tmp_path)
    _with_architectures(tmp_path, ["LlamaForCausalLm"])
    with pytest.raises(UnsupportedArchitectureError, match="did you mean 'LlamaForCausalLM'") as err:
        LLM(model=str(tmp_path), dtype="float32", max_model_len=32, block_size=8, skip_tokenizer_init=True)
    assert repr(str(tmp_path)) in str(err.value)


def test_missing_architectures_is_typed_error(tmp_path):
    make_checkpoint("llama", tmp_path)
    _with_architectures(tmp_path, [])
    with pytest.raises(UnsupportedArchitectureError, match="declares no `architectures`"):
        LLM(model=str(tmp_path), dtype="float32", max_model_len=32, block_size=8, skip_tokenizer_init=True)
