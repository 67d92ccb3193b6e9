"""Over-long prompts are refused after tokenizing a bounded prefix, not the whole text."""

from __future__ import annotations

import pytest
from keel_io_processors.chat import ChatProcessor
from keel_io_processors.completion import CompletionProcessor
from keel_io_processors.protocol import InvalidRequestError

from keel.testing.tokenizer import CountingTokenizer, build_tokenizer


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
