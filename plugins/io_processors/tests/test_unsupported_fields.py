"""Fields OpenAI / vLLM define that the server does not implement are a 400 naming them, never ignored."""

from __future__ import annotations

import pytest
from keel_io_processors.chat import ChatProcessor
from keel_io_processors.completion import CompletionProcessor
from keel_io_processors.protocol import InvalidRequestError

from keel.testing.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    tok = build_tokenizer(tmp_path_factory.mktemp("tok"))
    return (CompletionProcessor(tokenizer=tok, max_model_len=64), ChatProcessor(tokenizer=tok, max_model_len=64))


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("field, value", [
    ("logits_processors", ["my.mod:Proc"]),
    ("structural_tag", "{}"),
])
@pytest.mark.parametrize("chat", [False, True])
def test_unimplemented_fields_are_a_400_naming_them(procs, chat, field, value):
    proc = procs[chat]
    body = {"messages": MSG} if chat else {"prompt": "x"}
    with pytest.raises(InvalidRequestError) as err:
        proc.parse_request({**body, field: value})
    assert err.value.param == field and field in err.value.message


def test_chat_only_fields_and_nulls(procs):
    completion, chat = procs
    with pytest.raises(InvalidRequestError) as err:
        chat.parse_request({"messages": MSG, "functions": [{"name": "f"}]})
    assert err.value.param == "functions"
    # A null is "not set"; unrelated unknown extras stay accepted.
    chat.parse_request({"messages": MSG, "logits_processors": None, "some_future_field": 1})


@pytest.mark.parametrize("field, value, chat", [
    ("prediction", {"type": "content"}, False), ("logits_processors", ["m:P"], True), ("kv_transfer_params", {}, False),
    ("store", True, True), ("documents", [{"text": "x"}], True), ("prompt_embeds", "AAAA", False),
    ("request_id", "mine", True), ("mm_processor_kwargs", {}, False),
])
def test_more_known_fields_are_refused(procs, field, value, chat):
    body = {"messages": MSG} if chat else {"prompt": "x"}
    with pytest.raises(InvalidRequestError) as err:
        procs[chat].parse_request({**body, field: value})
    assert err.value.param == field


def test_no_op_values_pass_and_unknown_fields_are_logged(procs, caplog):
    completion, chat = procs
    with caplog.at_level("WARNING", logger="keel.io_processors"):
        chat.parse_request({"messages": MSG, "store": False, "service_tier": "auto",
                            "my_field": 1, "tools": None})
    assert "'my_field'" in caplog.text and "store" not in caplog.text and "tools" not in caplog.text
    with pytest.raises(InvalidRequestError) as err:
        completion.parse_request({"prompt": "x", "stream_options": {"include_usage": True}})
    assert err.value.param == "stream_options"
