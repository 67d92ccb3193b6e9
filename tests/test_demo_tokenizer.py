"""The locally trained demo tokenizer: loads with AutoTokenizer, round-trips text, renders chats."""

import json

import pytest
from transformers import AutoTokenizer

from keel.testing.tokenizer import BOS_TOKEN, EOS_TOKEN, build_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Café crème brûlée, naïve Ångström, São Paulo.",
    "日本語のテキスト 你好，世界 안녕하세요",
    "Emoji 😀🎉🚀 and a rare one 🦀 — “quoted” … 3.14159",
    "  leading spaces\n\tand tabs  \n",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    return AutoTokenizer.from_pretrained(str(tok_dir))


def test_files_and_special_tokens(tok_dir, tokenizer) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tok_dir / name).is_file()
    assert tokenizer.is_fast
    assert len(tokenizer) == 512
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.bos_token == BOS_TOKEN and tokenizer.eos_token == EOS_TOKEN
    config = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "{% if add_generation_prompt %}" in config["chat_template"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text) -> None:
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text


def test_has_merged_and_split_multibyte_tokens(tokenizer) -> None:
    # A frequent accented letter is one token; a rare emoji spans several byte tokens.
    assert any(tokenizer.decode([i]) == "é" for i in tokenizer("é", add_special_tokens=False).input_ids)
    crab = tokenizer("🦀", add_special_tokens=False).input_ids
    assert len(crab) > 1
    assert all("\ufffd" in tokenizer.decode([i]) for i in crab)


def test_chat_template_renders(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi there"}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt.endswith("Bye<|im_end|>\n")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in ids


def test_deterministic(tmp_path, tok_dir) -> None:
    build_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (tok_dir / name).read_bytes()


def test_vocab_size_too_small(tmp_path) -> None:
    with pytest.raises(ValueError, match="vocab_size=100"):
        build_tokenizer(tmp_path, vocab_size=100)
