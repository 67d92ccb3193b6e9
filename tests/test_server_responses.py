"""Response fields vLLM users rely on, against a real server: prompt_logprobs (checked against
transformers), return_token_ids, return_tokens_as_token_ids, cached tokens in usage, continuous usage
in streams, truncate_prompt_tokens, cache_salt, priority scheduling, best_of, generation-config defaults."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from keel.config import EngineArgs

pytest.importorskip("keel_endpoints")
from keel_endpoints.testing import make_tiny_model, serve_in_thread

LONG = "The quick brown fox jumps over the lazy dog while the river flows far away into the sea"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("model"))
    # generation_config.json defaults: greedy unless a request says otherwise
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    args = EngineArgs(model=str(model_dir), profile="cpu", max_model_len=128, num_kv_blocks=64, block_size=8,
                      scheduling_policy="priority", dtype="float32")
    with serve_in_thread(args, served_model_name="m") as s:
        yield s


def post(server, route: str, body: dict) -> dict:
    r = httpx.post(f"{server.base_url}/{route}", json={"model": "m", **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_prompt_logprobs_match_transformers(server, model_dir):
    from transformers import AutoModelForCausalLM

    out = post(server, "completions", {"prompt": "Hello there world", "max_tokens": 1, "prompt_logprobs": 2,
                                       "return_token_ids": True})
    choice = out["choices"][0]
    ids, plp = choice["prompt_token_ids"], choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for pos in range(1, len(ids)):
        entry = plp[pos][str(ids[pos])]
        assert math.isclose(entry["logprob"], float(ref[pos - 1, ids[pos]]), abs_tol=1e-3)
        assert len(plp[pos]) <= 3 and all(v["decoded_token"] is not None for v in plp[pos].values())
    chat = post(server, "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                             "prompt_logprobs": 0})
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1


def test_token_ids_and_tokens_as_ids(server):
    out = post(server, "completions", {"prompt": "Hello", "max_tokens": 4, "logprobs": 2, "return_token_ids": True,
                                       "return_tokens_as_token_ids": True, "ignore_eos": True})
    c = out["choices"][0]
    assert c["prompt_token_ids"] == server.engine.tokenizer.encode("Hello") and len(c["token_ids"]) == 4
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(k.startswith("token_id:") for top in c["logprobs"]["top_logprobs"] for k in top)
    chat = post(server, "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                             "logprobs": True, "return_token_ids": True, "ignore_eos": True,
                                             "return_tokens_as_token_ids": True})
    content = chat["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]
    assert chat["prompt_token_ids"] and chat["choices"][0]["token_ids"]


def test_cached_tokens_and_cache_salt(server):
    body = {"prompt": LONG, "max_tokens": 1}
    post(server, "completions", body)
    again = post(server, "completions", body)["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] >= 8
    salted = post(server, "completions", {**body, "cache_salt": "tenant-a"})["usage"]
    assert salted["prompt_tokens_details"]["cached_tokens"] == 0  # another tenant's blocks are not shared
    assert post(server, "completions", {**body, "cache_salt": "tenant-a"})["usage"]["prompt_tokens_details"][
        "cached_tokens"] >= 8


def test_continuous_usage_stats(server):
    body = {"model": "m", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usages = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"] is not None for c in chunks) and usages == sorted(usages) and usages[-1] == 4


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    ids = server.engine.tokenizer.encode(LONG)
    out = post(server, "completions", {"prompt": LONG, "max_tokens": 1, "truncate_prompt_tokens": 5,
                                       "return_token_ids": True})
    assert out["usage"]["prompt_tokens"] == 5 and out["choices"][0]["prompt_token_ids"] == ids[-5:]
    chat = post(server, "chat/completions", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 1,
                                             "truncate_prompt_tokens": 6})
    assert chat["usage"]["prompt_tokens"] == 6


def test_priority_is_accepted_under_the_priority_policy(server):
    assert post(server, "completions", {"prompt": "Hello", "max_tokens": 2, "priority": -5})["choices"]


def test_best_of_keeps_the_most_likely(server):
    out = post(server, "completions", {"prompt": "Hello", "max_tokens": 3, "n": 1, "best_of": 3,
                                       "temperature": 1.0, "seed": 7, "ignore_eos": True})
    assert len(out["choices"]) == 1 and out["choices"][0]["index"] == 0 and out["choices"][0]["logprobs"] is None
    assert out["usage"]["completion_tokens"] == 9  # every sample is generated (and billed, as OpenAI)
    full = post(server, "completions", {"prompt": "Hello", "max_tokens": 3, "n": 3, "temperature": 1.0, "seed": 7,
                                        "ignore_eos": True, "logprobs": 0})
    scores = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in full["choices"]}
    assert out["choices"][0]["text"] == max(scores, key=scores.get)


def test_generation_config_defaults_apply_to_unset_fields(server):
    a = post(server, "completions", {"prompt": "Once upon a time", "n": 2, "ignore_eos": True})
    assert a["choices"][0]["text"] == a["choices"][1]["text"]  # temperature 0 from generation_config.json
    chat = post(server, "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
    assert chat["usage"]["completion_tokens"] == 5  # max_new_tokens from generation_config.json
    hot = post(server, "completions", {"prompt": "Once upon a time", "n": 4, "temperature": 2.0, "seed": 1,
                                       "ignore_eos": True})
    assert len({c["text"] for c in hot["choices"]}) > 1  # an explicit value still wins


def test_chat_echo_prepends_the_last_assistant_message(server):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    body = {"messages": messages, "echo": True, "continue_final_message": True, "add_generation_prompt": False,
            "max_tokens": 3}
    out = post(server, "chat/completions", body)
    assert out["choices"][0]["message"]["content"].startswith("Once upon")
    plain = post(server, "chat/completions", {**body, "echo": False})
    assert out["choices"][0]["message"]["content"] == "Once upon" + plain["choices"][0]["message"]["content"]
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json={"model": "m", **body, "stream": True},
                      timeout=60) as r:
        first = next(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Once upon"}


def test_request_phase_metrics_after_real_requests(server):
    import re

    post(server, "completions", {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics").text

    def value(name: str) -> float:
        return float(re.search(rf'^keel:{name}\{{engine="0",model_name="m"\}} (\S+)$', text, re.MULTILINE).group(1))

    for phase in ("queue", "prefill", "decode", "inference"):
        assert value(f"request_{phase}_time_seconds_count") >= 1
    assert value("request_time_per_output_token_seconds_count") >= 1 and value("request_params_n_count") >= 1
    assert value("request_generation_tokens_sum") >= 3 and value("iteration_tokens_total_count") >= 1
    assert value("request_inference_time_seconds_sum") >= value("request_decode_time_seconds_sum")


def reference_beam_search(model_dir, prompt_ids: list[int], width: int, steps: int) -> list[list[int]]:
    """vLLM's beam search (no EOS: ignore_eos) on transformers' float32 logprobs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    beams = [(list(prompt_ids), 0.0)]
    with torch.no_grad():
        for _ in range(steps):
            grown = []
            for tokens, cum in beams:
                lp = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)
                top = torch.topk(lp, 2 * width)
                grown += [(tokens + [int(t)], cum + float(v)) for v, t in zip(top.values, top.indices)]
            beams = sorted(grown, key=lambda b: b[1] / len(b[0]), reverse=True)[:width]
    return [tokens[len(prompt_ids):] for tokens, _ in beams]


def test_use_beam_search_matches_a_reference(server, model_dir):
    out = post(server, "completions", {"prompt": "Hello", "n": 2, "max_tokens": 3, "use_beam_search": True,
                                       "ignore_eos": True, "return_token_ids": True})
    ids = server.engine.tokenizer.encode("Hello")
    assert [c["token_ids"] for c in out["choices"]] == reference_beam_search(model_dir, ids, 2, 3)
    assert [c["index"] for c in out["choices"]] == [0, 1] and out["usage"]["completion_tokens"] == 6
    chat = post(server, "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                             "max_tokens": 2, "use_beam_search": True, "ignore_eos": True})
    assert len(chat["choices"]) == 2
    r = httpx.post(f"{server.base_url}/completions", json={"prompt": "x", "use_beam_search": True, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"
