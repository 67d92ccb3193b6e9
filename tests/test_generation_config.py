"""generation_config.json is read: its extra EOS ids stop generation, its sampling fields are the defaults
(`LLM.get_default_sampling_params`), `generation_config="vllm"` ignores it, a folder path replaces it."""

from __future__ import annotations

import json
import shutil

import pytest

from keel import LLM, SamplingParams
from keel.config import ConfigError, ModelConfig
from keel.testing.checkpoints import make_checkpoint
from keel.testing.tokenizer import build_tokenizer

PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("gencfg")
    tok = build_tokenizer(path, vocab_size=512)
    make_checkpoint("llama", path, vocab_size=len(tok), bos_token_id=1, eos_token_id=2)
    (path / "generation_config.json").unlink(missing_ok=True)  # each test writes its own
    return path


def _with_file(ckpt, tmp_path, content) -> str:
    path = tmp_path / "model"
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ckpt, path)
    (path / "generation_config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", max_model_len=64, block_size=8, seed=0, **kw)


@pytest.fixture(scope="module")
def base_tokens(ckpt):
    out = _llm(ckpt).generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12, "the random model must not hit its EOS in 12 tokens for this test"
    return list(out.token_ids)


def test_extra_eos_ids_stop_generation_unless_ignored(ckpt, tmp_path, base_tokens):
    # the first token that did not occur before it: an end-of-turn id the tokenizer does not know as EOS
    i = next(i for i in range(2, 12) if base_tokens[i] not in base_tokens[:i])
    path = _with_file(ckpt, tmp_path, {"eos_token_id": [2, base_tokens[i]], "bos_token_id": 1})
    out = _llm(path).generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == base_tokens[: i + 1] and out.finish_reason == "stop"
    ignored = _llm(path, generation_config="vllm").generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
    assert list(ignored.token_ids) == base_tokens and ignored.finish_reason == "length"
    no_eos = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert list(_llm(path).generate(PROMPT, no_eos, use_tqdm=False)[0].outputs[0].token_ids) == base_tokens


def test_sampling_fields_are_the_defaults(ckpt, tmp_path, base_tokens):
    sampled = _llm(_with_file(ckpt, tmp_path / "a", {"temperature": 0.5, "top_k": 3, "top_p": 0.8,
                                                      "max_new_tokens": 5, "do_sample": True}))
    defaults = sampled.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.max_tokens) == (0.5, 3, 0.8, 5)
    assert len(sampled.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids) == 5
    greedy = _llm(_with_file(ckpt, tmp_path / "b", {"temperature": 0.0, "max_new_tokens": 5}))
    out = greedy.generate(PROMPT, use_tqdm=False)[0].outputs[0]  # no sampling params: the model's defaults
    assert list(out.token_ids) == base_tokens[:5]
    assert _llm(ckpt, generation_config="vllm").get_default_sampling_params().max_tokens == SamplingParams().max_tokens


def test_a_folder_path_replaces_the_models_file(ckpt, tmp_path):
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    assert ModelConfig(model=str(ckpt), generation_config=str(other)).generation_config_fields == {
        "max_new_tokens": 3}
    with pytest.raises(ConfigError, match="no generation_config.json in that folder"):
        _ = ModelConfig(model=str(ckpt), generation_config=str(tmp_path / "nowhere")).generation_config_fields


@pytest.mark.parametrize("content,match", [
    ("{not json", "not a readable JSON file"),
    ({"eos_token_id": "2"}, "eos_token_id must be an id or a list of ids"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"temperature": "hot"}, "temperature must be a number"),
])
def test_a_broken_file_is_a_config_error_naming_it(ckpt, tmp_path, content, match):
    path = _with_file(ckpt, tmp_path, content)
    with pytest.raises(ConfigError, match=f"generation_config.json: {match}"):
        _ = ModelConfig(model=path).generation_config_fields
