"""The offline `LLM` API with a real (locally trained) tokenizer: text, chat, stops, logprobs, n, seeds,
errors, metrics, and the `keel generate` / `keel bench` commands."""

from __future__ import annotations

import json
import math

import pytest
import torch

from keel import LLM, SamplingParams
from keel.engine.processor import PromptTooLongError
from keel.testing.checkpoints import make_checkpoint
from keel.testing.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok-llama")
    tok = build_tokenizer(path, vocab_size=512)
    make_checkpoint("llama", path, vocab_size=len(tok), bos_token_id=1, eos_token_id=2)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), dtype="float32", max_model_len=96, block_size=8, seed=0)


def hf_greedy_ids(model_dir, prompt_ids, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def test_text_prompts_greedy_match_transformers(llm, model_dir):
    prompts = ["The quick brown fox", "Hello, world! How are", "a"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs):
        assert out.prompt == prompt
        assert out.prompt_token_ids == tok.encode(prompt)
        c = out.outputs[0]
        assert c.token_ids == hf_greedy_ids(model_dir, out.prompt_token_ids, 6)
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert c.finish_reason == "length"


def test_stop_string_truncates_and_sets_stop_reason(llm):
    base = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = base.text
    # a stop string from the middle of the greedy text
    cut = max(3, len(text) // 2)
    stop = text[cut : cut + 2]
    assert stop.strip(), "need a visible stop string"
    first = text.find(stop)
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include)
        c = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == (text[: first + len(stop)] if include else text[:first])
    assert llm.get_metrics()["num_requests_running"] == 0
    assert llm.get_metrics()["kv_cache_usage"] == 0.0


def test_logprobs_include_sampled_token_and_match_raw_distribution(llm, model_dir):
    params = SamplingParams(temperature=0.7, top_k=5, seed=11, max_tokens=5, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    out = llm.generate("The quick brown fox", params, use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 5
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = out.prompt_token_ids + c.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    total = 0.0
    for j, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        assert tok in lp and 3 <= len(lp) <= 4
        row = ref[len(out.prompt_token_ids) + j - 1]
        assert abs(lp[tok].logprob - float(row[tok])) < 1e-4  # raw, before temperature/top-k
        top = torch.topk(row, 3).indices.tolist()
        assert [t for t in lp if lp[t].rank <= 3 and t != tok or t in top][:1]
        for t in top:
            assert t in lp and abs(lp[t].logprob - float(row[t])) < 1e-4
        assert lp[tok].rank == 1 + int((row > row[tok]).sum())
        assert lp[tok].decoded_token is not None
        total += lp[tok].logprob
    assert math.isclose(c.cumulative_logprob, total, rel_tol=1e-6)
    # prompt logprobs: None first, then one dict per prompt token holding that token
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for p, d in enumerate(out.prompt_logprobs[1:], 1):
        t = out.prompt_token_ids[p]
        assert t in d and abs(d[t].logprob - float(ref[p - 1][t])) < 1e-4


def test_n_and_seeds_reproducible_whatever_the_batch(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    alone = llm.generate("Hello", params, use_tqdm=False)[0]
    assert [c.index for c in alone.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1  # children differ
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batched = llm.generate(["Other prompt here", "Hello", "x y z"], [other, params, other], use_tqdm=False)[1]
    assert [c.token_ids for c in batched.outputs] == [c.token_ids for c in alone.outputs]


def test_bad_input_raises_and_loses_nothing(llm):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 96}, use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [10**6]}, use_tqdm=False)
    # token ids inside sampling params are checked before queuing, not inside an engine step
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("x", SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate("x", SamplingParams(prompt_logprobs=10**5), use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["fine", "x"], [SamplingParams(), SamplingParams(stop_token_ids=[10**6])], use_tqdm=False)
    # one bad prompt in a batch: nothing was queued, the engine still works
    with pytest.raises(PromptTooLongError):
        llm.generate(["fine", {"prompt_token_ids": [5] * 200}], use_tqdm=False)
    assert llm.get_metrics()["num_requests_waiting"] == 0
    out = llm.generate("still works", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_extreme_but_valid_numbers_run_and_invalid_ones_name_the_field(llm):
    """The largest values SamplingParams accepts fit every array of the engine step; one past them is a
    ValueError naming the field (it used to be an OverflowError inside the step)."""
    edge = SamplingParams(top_k=2**63 - 1, min_tokens=2**63 - 1, max_tokens=None, seed=2**64 - 1,
                          temperature=3.4e38, repetition_penalty=3.4e38, logit_bias={5: 100.0, 6: -100.0},
                          stop_token_ids=[0], logprobs=3)
    out = llm.generate({"prompt_token_ids": [5] * 90}, edge, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    for kwargs, field in (({"top_k": 2**63}, "top_k"), ({"min_tokens": 2**63, "max_tokens": None}, "min_tokens")):
        with pytest.raises(ValueError, match=field) as err:
            llm.generate("x", SamplingParams(**kwargs), use_tqdm=False)
        assert err.value.param == field
    with pytest.raises(ValueError, match="vocabulary") as err:
        llm.generate({"prompt_token_ids": [2**64]}, use_tqdm=False)
    assert err.value.param == "prompt"
    assert len(llm.generate("still works", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs) == 1


def test_chat_renders_template(llm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    chat = llm.chat(msgs, params, use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    expected = tok.encode(rendered, add_special_tokens=False)
    assert chat.prompt_token_ids == expected
    direct = llm.generate({"prompt_token_ids": expected}, params, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids


def test_min_tokens_holds_off_stop_tokens(llm):
    allowed = 77  # every other id is a stop token: until min_tokens only 77 can be sampled
    stops = [t for t in range(512) if t != allowed]
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=3, stop_token_ids=stops)
    c = llm.generate("abc", params, use_tqdm=False)[0].outputs[0]
    assert c.token_ids[:3] == [allowed] * 3
    if len(c.token_ids) < 10:
        assert c.finish_reason == "stop" and c.stop_reason == c.token_ids[-1] != allowed
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=stops)
    c = llm.generate("abc", params, use_tqdm=False)[0].outputs[0]
    if c.token_ids[0] != allowed:
        assert len(c.token_ids) == 1 and c.finish_reason == "stop"


def test_metrics_keys(llm):
    m = llm.get_metrics()
    for key in ("num_requests_running", "num_requests_waiting", "kv_cache_usage", "num_preemptions_total",
                "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
                "generation_tokens_total"):
        assert key in m
    assert m["prompt_tokens_total"] > 0 and m["generation_tokens_total"] > 0
    assert 0.0 <= m["kv_cache_usage"] <= 1.0


def test_cached_prompt_tokens_counted(llm):
    prompt = {"prompt_token_ids": list(range(3, 40))}  # 37 tokens: 4 full blocks of 8 are cacheable
    params = SamplingParams(temperature=0, max_tokens=2)
    before = llm.get_metrics()["prompt_tokens_cached_total"]
    llm.generate([prompt], params, use_tqdm=False)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    m = llm.get_metrics()
    assert out.num_cached_tokens == 32 and m["prompt_tokens_cached_total"] - before == 32


def test_token_prompts_without_tokenizer_and_no_chunking(model_dir):
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, enable_chunked_prefill=False,
              max_model_len=64, dtype="float32")
    assert llm.llm_engine.core.scheduler.max_num_batched_tokens == 64  # a whole prompt fits one step
    outs = llm.generate([{"prompt_token_ids": [5] * 40}, {"prompt_token_ids": [7, 8, 9]}],
                        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    assert outs[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text needs a tokenizer", use_tqdm=False)


def test_cli_generate_and_bench(model_dir, capsys):
    from keel.cli import main

    rc = main(["generate", "--model", str(model_dir), "--prompt", "Hello", "--max-tokens", "4",
               "--temperature", "0", "--ignore-eos", "--json", "--max-model-len", "64"])
    assert rc == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["prompt"] == "Hello" and len(line["token_ids"]) == 4
    rc = main(["bench", "throughput", "--model", str(model_dir), "--num-prompts", "4", "--input-len", "8",
               "--output-len", "4", "--json", "--max-model-len", "64"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["num_prompts"] == 4 and res["output_tokens"] == 16 and res["output_tokens_per_s"] > 0
    # two rounds of prompts nothing else used: throughput, never prefix-cache hits
    assert len(res["rounds"]) == 2 and all(r["output_tokens"] == 16 for r in res["rounds"])
    from keel.bench import random_prompts
    seen = [random_prompts(4, 8, 1000, seed=s) for s in (-1, 0, 1)]
    assert not {tuple(p) for p in seen[1]} & ({tuple(p) for p in seen[0]} | {tuple(p) for p in seen[2]})
    rc = main(["bench", "latency", "--model", str(model_dir), "--input-len", "8", "--output-len", "4",
               "--num-iters", "1", "--json", "--max-model-len", "64"])
    assert rc == 0


@pytest.mark.parametrize("dtype,expected", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                            ("auto", torch.float32)])
def test_dtypes(model_dir, dtype, expected):
    llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=32, skip_tokenizer_init=True)
    assert llm.llm_engine.config.model.torch_dtype == expected
    runner = llm.llm_engine.core.worker.runner
    assert runner.kv_caches[0].dtype == expected
    assert next(runner.model.parameters()).dtype == expected
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
