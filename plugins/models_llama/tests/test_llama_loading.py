"""Strict weight loading: every mismatch between checkpoint and model is an error naming the tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from keel_models_llama.llama import LlamaForCausalLM
from keel_models_llama.qwen3 import Qwen3ForCausalLM
from llama_test_utils import hf_logits, load_keel, prefill_logits, random_prompts
from safetensors.torch import save_file

from keel.models.loader import ModelNotFoundError, WeightLoadError, iterate_safetensors, resolve_model_path
from keel.testing.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama")


def _rewrite(src: Path, dst: Path, state: dict[str, torch.Tensor]) -> Path:
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"))
    return dst


def _state(path: Path) -> dict[str, torch.Tensor]:
    return dict(iterate_safetensors(path))


def test_extra_tensor_is_named(llama_ckpt: Path, tmp_path: Path) -> None:
    state = _state(llama_ckpt) | {"model.layers.0.self_attn.extra.weight": torch.zeros(3)}
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.self_attn\.extra\.weight") as info:
        load_keel(LlamaForCausalLM, _rewrite(llama_ckpt, tmp_path / "x", state))
    assert info.value.unexpected == ["model.layers.0.self_attn.extra.weight"]


def test_missing_tensor_is_named(llama_ckpt: Path, tmp_path: Path) -> None:
    state = _state(llama_ckpt)
    del state["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight") as info:
        load_keel(LlamaForCausalLM, _rewrite(llama_ckpt, tmp_path / "x", state))
    assert info.value.missing == ["model.layers.1.mlp.down_proj.weight"]


def test_missing_stacked_shard_leaves_param_unloaded(llama_ckpt: Path, tmp_path: Path) -> None:
    state = _state(llama_ckpt)
    del state["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight"):
        load_keel(LlamaForCausalLM, _rewrite(llama_ckpt, tmp_path / "x", state))


def test_wrong_shapes_are_all_listed(llama_ckpt: Path, tmp_path: Path) -> None:
    state = _state(llama_ckpt)
    state["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(48, 64)
    state["model.norm.weight"] = torch.ones(65)
    with pytest.raises(WeightLoadError) as info:
        load_keel(LlamaForCausalLM, _rewrite(llama_ckpt, tmp_path / "x", state))
    names = " ".join(info.value.mismatched)
    assert "model.layers.0.self_attn.v_proj.weight" in names and "model.norm.weight" in names
    assert "(48, 64)" in str(info.value)


def test_harmless_entries_are_skipped(llama_ckpt: Path, tmp_path: Path) -> None:
    state = _state(llama_ckpt) | {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)}
    load_keel(LlamaForCausalLM, _rewrite(llama_ckpt, tmp_path / "x", state))


def test_tied_checkpoint_with_explicit_lm_head(tmp_path: Path) -> None:
    path = make_checkpoint("qwen3", tmp_path / "tied", tie_word_embeddings=True)
    state = _state(path)
    assert "lm_head.weight" not in state
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    model = load_keel(Qwen3ForCausalLM, _rewrite(path, tmp_path / "x", state))
    assert model.lm_head is model.model.embed_tokens


def test_untied_model_needs_lm_head(llama_ckpt: Path, tmp_path: Path) -> None:
    state = _state(llama_ckpt)
    del state["lm_head.weight"]
    with pytest.raises(WeightLoadError, match=r"lm_head\.weight"):
        load_keel(LlamaForCausalLM, _rewrite(llama_ckpt, tmp_path / "x", state))


def test_sharded_checkpoint(tmp_path: Path) -> None:
    path = make_checkpoint("qwen2", tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    prompts = random_prompts(300, [7, 12])
    from keel_models_llama.qwen2 import Qwen2ForCausalLM

    ours = prefill_logits(load_keel(Qwen2ForCausalLM, path), prompts)
    torch.testing.assert_close(ours, hf_logits(path, prompts), atol=1e-4, rtol=0)


def test_bin_fallback(llama_ckpt: Path, tmp_path: Path) -> None:
    dst = tmp_path / "bin"
    dst.mkdir()
    shutil.copy(llama_ckpt / "config.json", dst / "config.json")
    torch.save(_state(llama_ckpt), dst / "pytorch_model.bin")
    names = [n for n, _ in iterate_safetensors(dst)]
    assert sorted(names) == sorted(_state(llama_ckpt))
    load_keel(LlamaForCausalLM, dst)


def test_no_weight_files(tmp_path: Path) -> None:
    with pytest.raises(WeightLoadError, match="no \\*.safetensors"):
        list(iterate_safetensors(tmp_path))


def test_bfloat16_loading(llama_ckpt: Path) -> None:
    model = load_keel(LlamaForCausalLM, llama_ckpt, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # the loader restored it
    prompts = random_prompts(300, [9, 16])
    ours = prefill_logits(model, prompts)
    ref = hf_logits(llama_ckpt, prompts)
    assert ours.dtype == torch.float32
    # bfloat16 keeps ~3 significant digits; the float32 reference bounds the drift
    assert (ours - ref).abs().max() < 0.1 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_resolve_local_directory(llama_ckpt: Path) -> None:
    assert resolve_model_path(str(llama_ckpt)) == llama_ckpt


def test_resolve_file_is_an_error(llama_ckpt: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="is a file"):
        resolve_model_path(str(llama_ckpt / "config.json"))


def test_resolve_offline_gives_clear_error(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    pytest.importorskip("huggingface_hub")
    with pytest.raises(ModelNotFoundError, match="offline"):
        resolve_model_path("keel-test/definitely-not-a-model")
