"""The offline API as vLLM users type it: an explicit `LLM(...)` signature, the names importable from
`keel`, `reset_prefix_cache`, `sleep` / `wake_up`, `get_default_sampling_params`."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import keel
from keel import LLM, AsyncEngineArgs, EngineArgs, SamplingParams, TextPrompt, TokensPrompt
from keel.engine.llm import SERVER_ONLY_ARGS

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, max_model_len=128, num_kv_blocks=40, block_size=8, platform="cpu")


def test_llm_signature_is_explicit_and_follows_engine_args():
    params = inspect.signature(LLM.__init__).parameters
    assert not [p for p in params.values() if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    names = set(params) - {"self"}
    expected = {f.name for f in dataclasses.fields(EngineArgs)} - set(SERVER_ONLY_ARGS)
    assert names == expected
    assert all(params[n].kind == inspect.Parameter.KEYWORD_ONLY for n in names - {"model"})
    for name in names - {"model", "plugins", "profile", "plugin_options"}:  # documented in the docstring
        assert f"`{name}`" in LLM.__doc__, name


def test_unknown_or_server_only_argument_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="swap_space"):
        LLM("m", swap_space=4)
    with pytest.raises(TypeError, match="engine_core_process"):
        LLM("m", engine_core_process=True)


def test_names_importable_from_keel():
    assert issubclass(AsyncEngineArgs, EngineArgs) and keel.AsyncLLM.__name__ == "AsyncLLM"
    assert TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]}
    assert TextPrompt(prompt="hi") == {"prompt": "hi"}
    assert {"AsyncEngineArgs", "TokensPrompt", "TextPrompt", "EngineArgs"} <= set(keel.__all__)


def test_typed_prompts_generate(llm):
    outs = llm.generate([TokensPrompt(prompt_token_ids=[3, 4, 5]), TextPrompt(prompt="hello")], GREEDY,
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]


def test_get_default_sampling_params(llm):
    assert isinstance(llm.get_default_sampling_params(), SamplingParams)


def test_reset_prefix_cache_forgets_cached_prefixes(llm):
    prompt = TokensPrompt(prompt_token_ids=list(range(10, 42)))
    llm.generate(prompt, GREEDY, use_tqdm=False)
    hits = llm.get_metrics()["prefix_cache_hits_total"]
    llm.generate(prompt, GREEDY, use_tqdm=False)
    again = llm.get_metrics()["prefix_cache_hits_total"]
    assert again > hits  # the second run hit the cache
    assert llm.reset_prefix_cache() is True
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.get_metrics()["prefix_cache_hits_total"] == again  # nothing left to hit


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_and_wake_up_restores(llm, level):
    prompt = TokensPrompt(prompt_token_ids=list(range(50, 83)))
    before = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    worker = llm.llm_engine.core.worker
    llm.sleep(level)
    assert worker.runner is None if level == 2 else worker.runner.kv_caches == []
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # the refused request left nothing behind
    if level == 2:
        with pytest.raises(ValueError, match="wake them before"):
            llm.wake_up(["kv_cache"])
        llm.wake_up(["weights"])
        assert llm.llm_engine.core.is_sleeping()
    llm.wake_up()
    assert not llm.llm_engine.core.is_sleeping() and worker.runner.kv_caches
    after = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before


def test_sleep_refuses_bad_level_and_wake_up_unknown_tag(llm):
    with pytest.raises(ValueError, match="sleep level"):
        llm.sleep(3)
    with pytest.raises(ValueError, match="unknown wake_up tag"):
        llm.wake_up(["weight"])


def test_sleep_after_an_async_burst_waits_for_the_step_still_in_flight(tiny_model_dir):
    # Async scheduling launches a step for requests whose last token the step before produced: the
    # front end sees them finish while that step is still in flight; sleep waits for it, not refuses.
    llm = LLM(tiny_model_dir, max_model_len=128, num_kv_blocks=40, block_size=8, platform="cpu",
              async_scheduling=True)
    prompts = [TokensPrompt(prompt_token_ids=list(range(3, 3 + n))) for n in (5, 17)]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert llm.llm_engine.core._in_flight  # the situation this test is about
    llm.sleep(1)
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == before


def test_startup_heap_is_frozen_and_sleep_level_2_still_frees_the_model(tiny_model_dir):
    # keel.gc_heap: full collections walked the whole startup heap (~250 ms, twice a benchmark round on
    # an H200); frozen, they skip it -- and sleep thaws first, so the dropped model is still collected.
    import gc
    import weakref

    llm = LLM(tiny_model_dir, max_model_len=128, num_kv_blocks=40, block_size=8, platform="cpu")
    assert gc.get_freeze_count() > 0
    model = weakref.ref(llm.llm_engine.core.worker.runner.model)
    llm.sleep(2)
    gc.collect()
    assert model() is None
    llm.wake_up()
    assert llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
