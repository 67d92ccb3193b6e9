"""The demo checkpoint: builds once, loads with transformers, generates; default path is per user."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from keel.demo import DemoCheckpointError, build_demo_checkpoint, default_demo_path, is_demo_model


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    return build_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt")


def test_loads_and_generates(demo_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(demo_dir))
    model = AutoModelForCausalLM.from_pretrained(str(demo_dir))
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    assert config.vocab_size == len(tokenizer) == 512
    assert (config.bos_token_id, config.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert (config.hidden_size, config.num_hidden_layers) == (256, 4)
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 4)
    assert config.max_position_embeddings == 2048
    ids = tokenizer("Hello world", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert out.shape == (1, ids.shape[1] + 6)
    assert isinstance(tokenizer.decode(out[0, ids.shape[1] :]), str)


def test_idempotent(demo_dir) -> None:
    weights = demo_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_demo_checkpoint(demo_dir) == demo_dir
    assert weights.stat().st_mtime_ns == before


def test_same_seed_same_weights_and_rng_untouched(demo_dir, tmp_path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_demo_checkpoint(tmp_path / "again", seed=0)
    assert torch.equal(torch.rand(3), expected)
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (
        demo_dir / "model.safetensors"
    ).read_bytes()


def test_incomplete_build_is_rebuilt(tmp_path) -> None:
    path = build_demo_checkpoint(tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    build_demo_checkpoint(path)
    assert (path / "model.safetensors").is_file()
    meta = json.loads((path / "keel_demo.json").read_text())
    assert meta["seed"] == 0 and "model.safetensors" in meta["files"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_refuses_foreign_directory(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(DemoCheckpointError, match="not a keel demo checkpoint"):
        build_demo_checkpoint(tmp_path)


def test_default_path(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path))
    assert default_demo_path() == tmp_path / "demo-llama"
    monkeypatch.delenv("KEEL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_demo_path() == tmp_path / "xdg" / "keel" / "demo-llama"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_demo_path() == Path.home() / ".cache" / "keel" / "demo-llama"
    assert is_demo_model("demo") and not is_demo_model("meta-llama/Llama-3-8B")
