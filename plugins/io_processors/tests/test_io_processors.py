"""The completion and chat IO processors without a server: parsing, sampling params, templates, shapes."""

from __future__ import annotations

import pytest
from keel_io_processors.chat import ChatProcessor, ChatTemplateError
from keel_io_processors.completion import CompletionProcessor
from keel_io_processors.protocol import InvalidRequestError
from transformers import AutoTokenizer

from keel.engine.outputs import CompletionOutput, Logprob, RequestOutput
from keel.io import IOProcessor, RequestLimits
from keel.plugins.loader import load_plugins
from keel.testing.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def completion(tokenizer):
    return CompletionProcessor(tokenizer=tokenizer, served_model_name="m", max_model_len=64)


@pytest.fixture
def chat(tokenizer):
    return ChatProcessor(tokenizer=tokenizer, served_model_name="m", max_model_len=64)


def test_registered_under_io_processor_kind():
    registry = load_plugins(["io-processors"]).registry("io_processor")
    assert registry.get("completion") is CompletionProcessor
    assert registry.get("chat") is ChatProcessor
    assert isinstance(CompletionProcessor(), IOProcessor) and isinstance(ChatProcessor(), IOProcessor)


def test_unknown_fields_accepted_and_vllm_extras_reach_sampling_params(completion):
    req = completion.parse_request({
        "model": "m", "prompt": "hi", "max_tokens": 3, "user": "u", "some_future_field": {"x": 1},
        "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True, "min_tokens": 2,
        "stop_token_ids": [7], "stop": "zz", "seed": 3, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "temperature": 0.7, "top_p": 0.9, "n": 2, "logit_bias": {"5": 1.5},
    })
    sp = completion.sampling_params(req)
    assert (sp.top_k, sp.min_p, sp.repetition_penalty, sp.ignore_eos, sp.min_tokens) == (5, 0.1, 1.2, True, 2)
    assert sp.stop_token_ids == [7] and sp.stop == ["zz"] and sp.seed == 3 and sp.n == 2
    assert (sp.presence_penalty, sp.frequency_penalty, sp.temperature, sp.top_p) == (0.5, -0.5, 0.7, 0.9)
    assert sp.logit_bias == {5: 1.5} and sp.max_tokens == 3
    assert req.request_id.startswith("cmpl-") and req.created > 0


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),          # wrong type, never coerced
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -1.0}, "temperature"),
    ({"prompt": "x", "top_p": 0.0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "presence_penalty": 3.0}, "presence_penalty"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "logit_bias": {"a": 1.0}}, "logit_bias"),
    ({"prompt": "x", "suffix": "s"}, "suffix"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({}, "prompt"),
])
def test_completion_rejections_name_the_field(completion, body, param):
    with pytest.raises(InvalidRequestError) as err:
        completion.sampling_params(completion.parse_request(body))
    assert err.value.param is not None and err.value.param.startswith(param), err.value.message


def test_body_must_be_an_object(completion):
    with pytest.raises(InvalidRequestError, match="JSON object"):
        completion.parse_request(["prompt"])


def test_completion_prompt_forms(completion):
    def prompts(p):
        return completion.pre_process(completion.parse_request({"prompt": p}))

    assert [e.prompt for e in prompts("a")] == ["a"]
    assert [e.prompt_token_ids for e in prompts([1, 2])] == [(1, 2)]
    assert [e.prompt for e in prompts(["a", "b"])] == ["a", "b"]
    assert [e.prompt_token_ids for e in prompts([[1], [2, 3]])] == [(1,), (2, 3)]


def test_chat_renders_template_with_string_or_text_parts(chat, tokenizer):
    plain = chat.parse_request({"messages": [{"role": "user", "content": "Hello"}]})
    parts = chat.parse_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]})
    a, b = chat.pre_process(plain)[0], chat.pre_process(parts)[0]
    assert a.prompt == b.prompt == "<s><|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert a.prompt_token_ids == b.prompt_token_ids
    assert list(a.prompt_token_ids) == tokenizer.encode(a.prompt, add_special_tokens=False)
    assert chat.sampling_params(plain).max_tokens is None  # chat default: up to the context limit


def test_chat_rejections(chat):
    for body, param in [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.0"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ]:
        with pytest.raises(InvalidRequestError) as err:
            chat.sampling_params(chat.parse_request(body))
        assert err.value.param and err.value.param.startswith(param), (body, err.value.message)


def test_chat_without_template_is_a_clear_400(tokenizer, tmp_path):
    build_tokenizer(tmp_path)
    bare = AutoTokenizer.from_pretrained(tmp_path)
    bare.chat_template = None
    proc = ChatProcessor(tokenizer=bare, served_model_name="m")
    req = proc.parse_request({"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(ChatTemplateError, match="no chat template") as err:
        proc.pre_process(req)
    assert isinstance(err.value, InvalidRequestError)
    # A template given in the request is refused unless the server trusts request templates...
    body = {"messages": [{"role": "user", "content": "hi"}],
            "chat_template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"}
    with pytest.raises(InvalidRequestError, match="trust-request-chat-template") as err:
        proc.parse_request(body)
    assert err.value.param == "chat_template"
    # ...and then used instead.
    trusting = ChatProcessor(tokenizer=bare, served_model_name="m",
                             limits=RequestLimits(trust_request_chat_template=True))
    assert trusting.pre_process(trusting.parse_request(body))[0].prompt == "[hi]"


def _lp(tid, lp, rank, text):
    return tid, Logprob(lp, rank, text)


def _output(text, token_ids, logprobs=None, finish=None, prompt="p", prompt_ids=(1, 2), n_index=0):
    return RequestOutput("r", prompt, list(prompt_ids), None,
                         [CompletionOutput(n_index, text, token_ids, None, logprobs, finish)], finish is not None)


def test_completion_response_shapes_logprobs_and_usage(completion):
    req = completion.parse_request({"prompt": "p", "logprobs": 1, "model": "m"})
    entries = [dict([_lp(5, -0.5, 2, "a"), _lp(6, -0.1, 1, "b")]), dict([_lp(7, -0.2, 1, "c")])]
    body = completion.post_process(req, [_output("ac", [5, 7], entries, "length")])
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["model"] == "m"
    assert choice["text"] == "ac" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {"tokens": ["a", "c"], "token_logprobs": [-0.5, -0.2],
                                  "top_logprobs": [{"b": -0.1, "a": -0.5}, {"c": -0.2}], "text_offset": [0, 1]}
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_logprobs_shape(chat):
    req = chat.parse_request({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 1})
    entries = [dict([_lp(5, -0.5, 2, "é"), _lp(6, -0.1, 1, "b")])]
    body = chat.post_process(req, [_output("é", [5], entries, "stop")])
    content = body["choices"][0]["logprobs"]["content"]
    assert content == [{"token": "é", "logprob": -0.5, "bytes": [195, 169],
                        "top_logprobs": [{"token": "b", "logprob": -0.1, "bytes": [98]}]}]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "é"}


def test_chat_stream_role_first_finish_on_last_content_chunk_then_usage(chat):
    req = chat.parse_request({"messages": [{"role": "user", "content": "x"}], "stream": True,
                              "stream_options": {"include_usage": True}})
    stream = chat.create_stream(req)
    chunks = stream.on_output(0, _output("He", [3]))
    chunks += stream.on_output(0, _output("", [], finish=None))  # nothing new: no chunk
    chunks += stream.on_output(0, _output("llo", [4, 2], finish="stop"))
    chunks += stream.finish()
    deltas = [c["choices"][0]["delta"] if c["choices"] else None for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "He"}, {"content": "llo"}, None]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "stop"]
    assert all(c["usage"] is None for c in chunks[:3])
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    assert {c["id"] for c in chunks} == {req.request_id}


def test_completion_stream_echo_and_choice_indices(completion):
    req = completion.parse_request({"prompt": ["a", "b"], "n": 2, "echo": True, "stream": True})
    stream = completion.create_stream(req)
    first = stream.on_output(1, _output("x", [9], prompt="b", n_index=1))
    again = stream.on_output(1, _output("y", [9], prompt="b", n_index=1, finish="length"))
    assert first[0]["choices"][0] == {"index": 3, "text": "bx", "logprobs": None, "finish_reason": None,
                                      "stop_reason": None}
    assert again[0]["choices"][0]["text"] == "y" and again[0]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in first[0] and stream.finish() == []
