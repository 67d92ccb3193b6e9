"""Choosing logits processors and passing them arguments: every name resolves or startup stops naming
it, arguments nobody reads are refused, a processor's own check is the request's error, and the server
maps `vllm_xargs` onto `SamplingParams.extra_args`."""

from __future__ import annotations

import argparse

import pytest

from keel import LLM, SamplingParams
from keel.config import ConfigError, EngineArgs
from keel.testing.checkpoints import make_checkpoint
from keel.testing.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lp-config")
    make_checkpoint("llama", path, vocab_size=320)
    build_tokenizer(path, vocab_size=320)
    return path


def config(model_dir, **kw):
    return EngineArgs(model=str(model_dir), max_model_len=64, **kw).create_engine_config()


def test_unknown_names_and_speculative_decoding_stop_startup(model_dir):
    assert config(model_dir, logits_processors=["no_repeat_ngram"]).model.logits_processors == ("no_repeat_ngram",)
    with pytest.raises(ConfigError, match="'no_such'.*no_repeat_ngram"):
        config(model_dir, logits_processors=["no_such"])
    with pytest.raises(ConfigError, match="cannot import 'keel_logits_processors:Nope'"):
        config(model_dir, logits_processors=["keel_logits_processors:Nope"])
    with pytest.raises(ConfigError, match="speculative_config"):
        config(model_dir, logits_processors=["no_repeat_ngram"],
               speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="logits_processors must be a list"):
        config(model_dir, logits_processors="no_repeat_ngram")


def test_cli_flag_takes_names():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--logits-processors", "no_repeat_ngram", "pkg.mod:Cls"])
    assert EngineArgs.from_cli_args(ns).logits_processors == ["no_repeat_ngram", "pkg.mod:Cls"]


def test_extra_args_need_a_processor_and_pass_its_check(model_dir):
    plain = LLM(model=str(model_dir), max_model_len=64)
    with pytest.raises(ValueError, match="extra_args are read by logits processors") as err:
        plain.generate(["Hi"], SamplingParams(max_tokens=2, extra_args={"no_repeat_ngram_size": 2}), use_tqdm=False)
    assert err.value.param == "extra_args"
    plain.llm_engine.shutdown()
    llm = LLM(model=str(model_dir), max_model_len=64, logits_processors=["no_repeat_ngram"])
    with pytest.raises(ValueError, match="extra_args.no_repeat_ngram_size must be"):
        llm.generate(["Hi"], SamplingParams(max_tokens=2, extra_args={"no_repeat_ngram_size": 0}), use_tqdm=False)
    (out,) = llm.generate(["Hi"], SamplingParams(max_tokens=2, extra_args={"other": 1}), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2  # keys no processor reads are each processor's business
    llm.llm_engine.shutdown()
    with pytest.raises(ValueError, match="extra_args must be a mapping"):
        SamplingParams(extra_args=["no_repeat_ngram_size"])


def test_server_maps_vllm_xargs(tmp_path):
    pytest.importorskip("keel_io_processors")
    from keel_io_processors.completion import CompletionProcessor
    from keel_io_processors.protocol import InvalidRequestError

    proc = CompletionProcessor(tokenizer=build_tokenizer(tmp_path), max_model_len=64)
    request = proc.parse_request({"prompt": "x", "vllm_xargs": {"no_repeat_ngram_size": 3}})
    assert proc.sampling_params(request).extra_args == {"no_repeat_ngram_size": 3}
    with pytest.raises(InvalidRequestError) as err:
        proc.parse_request({"prompt": "x", "vllm_xargs": {"k": {"nested": 1}}})
    assert err.value.param.startswith("vllm_xargs")
