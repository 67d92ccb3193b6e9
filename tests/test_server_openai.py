"""A real keel API server on a loopback port, driven by the official `openai` client (sync and async):
completions and chat, streaming and not, n > 1, logprobs, echo, stop strings, usage, utility routes."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from keel.config import EngineArgs

pytest.importorskip("keel_endpoints")
import itertools

from keel_endpoints.testing import make_tiny_model, serve_in_thread

MODEL = "tiny-llama"
KEY = "sk-test"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("model"))
    args = EngineArgs(model=str(path), profile="cpu", max_model_len=256, num_kv_blocks=128, max_num_seqs=64)
    with serve_in_thread(args, api_key=KEY, served_model_name=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_greedy_is_deterministic_with_usage(client):
    a = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0)
    b = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 6 and a.usage.prompt_tokens > 0
    assert a.id.startswith("cmpl-") and a.model == MODEL and a.object == "text_completion"


def test_completion_stream_equals_non_stream(client):
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    content = [c for c in chunks if c.choices]
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert len(content) > 2  # tokens flowed as they were generated, not in one piece
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_seeded_sampling_with_penalties_is_reproducible(client):
    kw = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "seed": 1234,
              "presence_penalty": 0.5, "frequency_penalty": 0.5}
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_n_greater_than_one_and_batched_prompts(client):
    r = client.completions.create(model=MODEL, prompt=["Hello", "The river"], n=3, max_tokens=4, seed=7,
                                  temperature=1.0)
    assert sorted(c.index for c in r.choices) == list(range(6))
    assert r.usage.completion_tokens == 24
    chat = client.chat.completions.create(model=MODEL, n=2, max_tokens=4, seed=3,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert sorted(c.index for c in chat.choices) == [0, 1]
    streamed = client.chat.completions.create(model=MODEL, n=2, max_tokens=4, stream=True,
                                              messages=[{"role": "user", "content": "Hi"}])
    finishes = {}
    for chunk in streamed:
        for c in chunk.choices:
            assert c.index not in finishes, "no chunk for a choice after its finish_reason"
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert finishes == {0: "length", 1: "length"}


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert "".join(lp.tokens) == r.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and top[token] == value and 1 <= len(top) <= 3
        assert value == max(top.values())  # greedy: the sampled token is the most likely
    echo = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, echo=True, logprobs=1,
                                     temperature=0)
    assert echo.choices[0].text == "Hello world" + r.choices[0].text
    assert echo.choices[0].logprobs.token_logprobs[0] is None  # the first prompt token has no context
    assert echo.choices[0].logprobs.token_logprobs[-3:] == lp.token_logprobs


def test_chat_logprobs_and_top_logprobs(client):
    r = client.chat.completions.create(model=MODEL, max_tokens=3, logprobs=True, top_logprobs=2, temperature=0,
                                       messages=[{"role": "user", "content": "Hello"}])
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == c.logprob  # greedy
        assert bytes(c.bytes).decode("utf-8", "replace") == c.token


def test_chat_text_parts_render_like_a_string(client):
    kw = {"model": MODEL, "max_tokens": 5, "temperature": 0}
    a = client.chat.completions.create(messages=[{"role": "user", "content": "Hello"}], **kw)
    b = client.chat.completions.create(messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
                                       **kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.role == "assistant" and a.usage.prompt_tokens == b.usage.prompt_tokens


def test_chat_stream_role_then_content_then_usage(client):
    kw = {"model": MODEL, "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": "Hi there"}]}
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6


def _boundary_stop(client) -> tuple[str, str]:
    """A greedy continuation and a 2-character stop string spanning two of its (ASCII) tokens."""
    r = client.completions.create(model=MODEL, prompt="The scheduler decides", max_tokens=24, temperature=0,
                                  logprobs=0)
    tokens, text = r.choices[0].logprobs.tokens, r.choices[0].text
    pos = 0
    for a, b in itertools.pairwise(tokens):
        pos += len(a)
        stop = a[-1:] + b[:1]
        if len(stop) == 2 and stop.isascii() and stop.isprintable() and text.find(stop) == pos - 1 and pos > 3:
            return text, stop
    pytest.skip("no ASCII token boundary in the greedy continuation")


def test_stop_string_partial_match_is_held_back_while_streaming(client):
    text, stop = _boundary_stop(client)
    expected = text[: text.find(stop)]
    kw = {"model": MODEL, "prompt": "The scheduler decides", "max_tokens": 24, "temperature": 0, "stop": [stop]}
    r = client.completions.create(**kw)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = [c for c in client.completions.create(stream=True, **kw)]
    streamed = [c.choices[0].text for c in chunks]
    # Had the first character of the stop string been sent before it was resolved, it would be here.
    assert "".join(streamed) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_vllm_extra_sampling_fields_are_accepted(client):
    r = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 4,
                    "stop_token_ids": [2], "skip_special_tokens": True, "unknown_future_field": 1},
    )
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"


def test_async_client_concurrent_streams(server):
    async def run():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0) as aclient:
            async def one(i):
                text = ""
                stream = await aclient.chat.completions.create(
                    model=MODEL, max_tokens=5, temperature=0, stream=True,
                    messages=[{"role": "user", "content": f"Question {i}"}])
                async for chunk in stream:
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                return text

            single = await aclient.chat.completions.create(
                model=MODEL, max_tokens=5, temperature=0, messages=[{"role": "user", "content": "Question 0"}])
            texts = await asyncio.gather(*(one(i) for i in range(6)))
            return single.choices[0].message.content, texts

    single, texts = asyncio.run(run())
    assert texts[0] == single and all(texts)


def test_api_key_required_on_api_routes(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{server.base_url}/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key" and set(r.json()["error"]) == {
            "message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key


def test_tokenize_detokenize_version(server):
    h = {"Authorization": f"Bearer {KEY}"}
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}, headers=h).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}, headers=h).json()
    assert detok["prompt"].endswith("Hello world")
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                      headers=h).json()
    assert chat["count"] > tok["count"] - 2
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**6]}, headers=h)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.get(f"{server.url}/version").json()["version"]
