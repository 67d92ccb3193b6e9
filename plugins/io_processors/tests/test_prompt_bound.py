"""Over-long prompts are refused after tokenizing a bounded prefix, not the whole text."""

from __future__ import annotations

import pytest
from keel_io_processors.chat import ChatProcessor
from keel_io_processors.completion import CompletionProcessor
from keel_io_processors.protocol import InvalidRequestError

from keel.testing.tokenizer import build_tokenizer


class CountingTokenizer:
    """Delegates to a real tokenizer and records how many characters each encode call got."""

    def __init__(self, tok):
        self.tok = tok
        self.encoded: list[int] = []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text, **kwargs):
        self.encoded.append(len(text))
        return self.tok.encode(text, **kwargs)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def test_huge_prompt_is_refused_after_a_bounded_prefix(tokenizer):
    spy = CountingTokenizer(tokenizer)
    proc = CompletionProcessor(tokenizer=spy, max_model_len=64)
    limit = (64 + 16) * max(len(t) for t in tokenizer.get_vocab())
    with pytest.raises(InvalidRequestError, match="max_model_len") as err:
        proc.pre_process(proc.parse_request({"prompt": "hello world " * 500_000}))  # 6 MB
    assert err.value.param == "prompt" and spy.encoded == [limit]
    chat = ChatProcessor(tokenizer=spy, max_model_len=64)
    spy.encoded.clear()
    with pytest.raises(InvalidRequestError, match="max_model_len") as err:
        chat.pre_process(chat.parse_request({"messages": [{"role": "user", "content": "hi there " * 300_000}]}))
    assert err.value.param == "messages" and spy.encoded == [limit]


def test_prompts_that_fit_are_tokenized_whole_and_unchanged(tokenizer):
    proc = CompletionProcessor(tokenizer=tokenizer, max_model_len=64)
    text = "hello world " * 3
    assert proc.pre_process(proc.parse_request({"prompt": text, "max_tokens": 1}))[0].prompt_token_ids == tuple(
        tokenizer.encode(text))
    # Long in characters but few tokens (a deleting normalizer would do this): tokenized whole, not refused.
    sparse = CountingTokenizer(tokenizer)
    sparse.get_vocab = lambda: {"ab": 0}  # pretend no token covers more than 2 characters
    proc = CompletionProcessor(tokenizer=sparse, max_model_len=4096)
    long_text = "hello world " * 400  # ~1 token per 5 characters: fits in 4096 tokens
    ids = proc.pre_process(proc.parse_request({"prompt": long_text, "max_tokens": 1}))[0].prompt_token_ids
    assert ids == tuple(tokenizer.encode(long_text)) and sparse.encoded[-1] == len(long_text)
