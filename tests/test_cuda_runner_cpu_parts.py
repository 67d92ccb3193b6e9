"""CPU-checkable parts of the CUDA work: load_format="dummy", the profiling forward, graph buckets."""

from __future__ import annotations

import json

import pytest
import torch

from keel import SamplingParams
from keel.config import ConfigError, EngineArgs, ModelConfig
from keel.engine.llm_engine import LLMEngine
from keel.platform import Platform
from keel.testing.checkpoints import tiny_config
from keel.worker.cuda_graph import DecodeGraphRunner


def _config_only(path):
    config = tiny_config("llama")
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)  # config.json, no weights at all


def test_load_format_validated():
    with pytest.raises(ConfigError, match="load_format"):
        ModelConfig(model="x", load_format="npz")


def test_dummy_weights_need_only_a_config(tmp_path):
    _config_only(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", load_format="dummy", max_model_len=64))
    model = engine.core.worker.runner.model
    params = dict(model.named_parameters())
    assert torch.all(params["model.norm.weight"] == 1.0)
    w = params["model.layers.0.mlp.down_proj.weight"]
    assert 0.5 < float(w.detach().std() * w.shape[1] ** 0.5) < 1.5 and torch.isfinite(w).all()
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert len(outs[0].outputs[0].token_ids) == 3
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_profile_run_returns_temporary_cache_bytes(tmp_path):
    _config_only(tmp_path)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", load_format="dummy", max_model_len=64))
    runner = engine.core.worker.runner
    temp = runner.profile_run(num_tokens=150, max_num_seqs=8, max_model_len=64)  # requests 64 + 64 + 22
    blocks = 4 + 4 + 2 + 1  # block size 16, plus the null block
    assert temp == blocks * runner.kv_cache_bytes_per_block()


def test_platform_base_memory_queries_default_to_unknown():
    p = Platform()
    p.reset_peak_memory_stats()
    assert p.peak_memory_allocated() is None and p.memory_allocated() is None


def test_graph_runner_buckets_and_declines_non_decode_steps():
    g = DecodeGraphRunner(torch.nn.Identity(), [], [], [], torch.device("cpu"), 16, [8, 1, 4, 2], 100)
    assert g.sizes == [1, 2, 4, 8] and g.block_table.shape == (8, 7)
    assert [g.bucket(n) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]

    class Step:
        num_reqs, max_query_len, num_actual_tokens = 2, 3, 6
        block_table = torch.zeros(2, 3)

    assert g.run(torch.zeros(6), torch.zeros(6), Step()) is None  # a prefill never replays
