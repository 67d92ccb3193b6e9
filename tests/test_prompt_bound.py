"""PromptBound: a prompt far past max_model_len is refused after tokenizing a prefix; others are untouched."""

from __future__ import annotations

import pytest

from keel.engine.processor import Processor, PromptTooLongError
from keel.engine.prompt_bound import MARGIN, PromptBound
from keel.testing.tokenizer import CountingTokenizer, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def test_offline_processor_refuses_a_huge_prompt_after_a_prefix(tokenizer):
    spy = CountingTokenizer(tokenizer)
    proc = Processor(spy, max_model_len=64, vocab_size=len(tokenizer), eos_token_id=None)
    with pytest.raises(PromptTooLongError, match="max_model_len") as err:
        proc.process_prompt("lorem ipsum " * 1_000_000)  # 12 MB
    limit = (64 + MARGIN) * max(len(t) for t in tokenizer.get_vocab())
    assert spy.encoded == [limit] and err.value.param == "prompt"
    assert proc.process_prompt("lorem ipsum").prompt_token_ids == tokenizer.encode("lorem ipsum")


def test_text_long_in_characters_but_short_in_tokens_is_tokenized_whole(tokenizer):
    spy = CountingTokenizer(tokenizer)
    spy.get_vocab = lambda: {"ab": 0}  # as if no token stood for more than 2 characters
    text = "hello world " * 400  # ~5 characters a token: 1,000 tokens
    assert PromptBound(spy, 4096).encode(text) == tokenizer.encode(text) and spy.encoded[-1] == len(text)
    assert PromptBound(tokenizer, None).encode(text) == tokenizer.encode(text)  # no limit known: no bound
