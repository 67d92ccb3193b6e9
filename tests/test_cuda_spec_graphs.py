"""Speculative verify steps under CUDA graphs (skipped without a GPU).

Every request of a verify step carries 1 + k tokens; when all carry the same number the model runner
replays a graph captured for (1 + k, batch bucket) instead of running the forward eagerly. Greedy tokens
and their logprobs must equal the eager speculative run and non-speculative decoding, for n-gram drafts
on a Llama (triton_flash) and MTP drafts on a DeepSeek-V3 (triton_mla), and the runner's replay counter
for 1 + k must move.

Needs `ModelRunner.capture_cuda_graphs` to pass `query_lens=graph_query_lens(...)` to the capturer;
`test_manual_capture_*` build the graph runner themselves and do not depend on that.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.fidelity import greedy_tokens_and_logprobs
from keel.worker.cuda_graph import DecodeGraphRunner, graph_query_lens

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

K = 3  # ngram drafts per step: verify steps of 4 tokens per request
MTP_K = 2


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    from test_cuda_runner_cpu_parts import make_cycle_checkpoint

    return make_cycle_checkpoint(tmp_path_factory.mktemp("spec_graphs") / "llama", head_dim=64,
                                 num_hidden_layers=2, vocab_size=48, max_position_embeddings=512)


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    tests = Path(__file__).resolve().parents[1] / "plugins" / "models_deepseek" / "tests"
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    from test_mtp_engine import make_mtp_checkpoint

    return make_mtp_checkpoint(tmp_path_factory.mktemp("spec_graphs") / "v3")


def _llama(path, spec: bool, eager: bool) -> LLMEngine:
    args = {"model": str(path), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 16,
            "max_model_len": 256, "plugins": ["platform-cuda", "attention-flash", "models-llama"],
            "platform": "cuda", "attention_backend": "triton_flash", "max_num_seqs": 8,
            "gpu_memory_utilization": 0.3, "enforce_eager": eager}
    if spec:
        args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
                                      "prompt_lookup_max": 3}
    return LLMEngine.from_engine_args(EngineArgs(**args))


def _deepseek(path, spec: bool, eager: bool, **kw) -> LLMEngine:
    args = {"model": str(path), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 16,
            "max_model_len": 256,
            "plugins": ["platform-cuda", "attention-flash", "models-deepseek", "kernels-triton"],
            "platform": "cuda", "attention_backend": "triton_mla", "max_num_seqs": 8,
            "gpu_memory_utilization": 0.3, "enforce_eager": eager, "seed": 0, **kw}
    if spec:
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": MTP_K}
    return LLMEngine.from_engine_args(EngineArgs(**args))


def _greedy(engine: LLMEngine, prompts, n: int):
    tokens, logprobs = greedy_tokens_and_logprobs(engine, prompts, n)
    return tokens, torch.tensor(logprobs)


def _cycle_prompts() -> list[list[int]]:
    # Each holds a whole cycle of the checkpoint's x -> x + 1 (mod 6 within blocks of 6): full drafts.
    return [[b * 6 + (s + i) % 6 for i in range(6 + extra)] for b, s, extra in
            [(0, 0, 2), (1, 3, 0), (2, 1, 5), (3, 5, 1), (4, 2, 3)]]


def _assert_same(a, b) -> None:
    assert a[0] == b[0]
    torch.testing.assert_close(a[1], b[1], atol=1e-4, rtol=0)


def test_ngram_verify_steps_replay_graphs(llama_ckpt):
    prompts = _cycle_prompts()
    base = _greedy(_llama(llama_ckpt, spec=False, eager=True), prompts, 24)
    _assert_same(_greedy(_llama(llama_ckpt, spec=True, eager=True), prompts, 24), base)
    engine = _llama(llama_ckpt, spec=True, eager=False)
    graphs = engine.core.worker.runner.cuda_graphs
    assert graphs is not None and graphs.query_lens == [1, 1 + K]
    _assert_same(_greedy(engine, prompts, 24), base)
    assert graphs.replays_by_query_len[1 + K] > 0


def test_mtp_verify_steps_replay_graphs(mtp_ckpt):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 37, 1, 20, 9)]
    base = _greedy(_deepseek(mtp_ckpt, spec=False, eager=True), prompts, 16)
    eager_engine = _deepseek(mtp_ckpt, spec=True, eager=True)
    eager = _greedy(eager_engine, prompts, 16)
    _assert_same(eager, base)
    key = "spec_decode_num_accepted_tokens_total"
    eager_accepted = eager_engine.get_metrics()[key]
    eager_engine.shutdown()
    engine = _deepseek(mtp_ckpt, spec=True, eager=False)
    runner = engine.core.worker.runner
    assert {layer.backend.name for layer in runner.attn_layers} == {"triton_mla"}
    graphs = runner.cuda_graphs
    assert graphs is not None and graphs.query_lens == [1, 1 + MTP_K]
    _assert_same(_greedy(engine, prompts, 16), base)
    assert graphs.replays_by_query_len[1 + MTP_K] > 0
    # The drafts replayed their own graphs (worker/draft_graph.py) and drafted what the eager MTP drafted.
    assert runner.draft_graphs is not None and runner.draft_graphs.num_replays > 0
    assert engine.get_metrics()[key] == eager_accepted > 0


def test_mtp_async_scheduling_builds_verify_inputs_on_the_device(mtp_ckpt):
    """Async scheduling is on by default here: MTP steps take the previous step's bonus token, drafts and
    rejected count from the device (no host wait), and outputs equal synchronous MTP and plain decoding."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 37, 1, 20, 9)]
    base = _greedy(_deepseek(mtp_ckpt, spec=False, eager=True), prompts, 16)
    _assert_same(_greedy(_deepseek(mtp_ckpt, spec=True, eager=False, async_scheduling=False), prompts, 16), base)
    engine = _deepseek(mtp_ckpt, spec=True, eager=False)
    assert engine.core.async_scheduling
    _assert_same(_greedy(engine, prompts, 16), base)
    spec = engine.core.worker.runner.spec
    assert spec.num_device_fixed > 0 and spec.num_host_waits == 0


@pytest.mark.parametrize("model", ["llama", "deepseek"])
def test_manual_capture_matches_eager(model, request):
    """The capture itself, independent of how the model runner is wired: an eager speculative engine gets
    a graph runner for query lengths (1, 1 + k) built from its own parts; outputs stay the eager ones."""
    if model == "llama":
        make, path, k, prompts = _llama, request.getfixturevalue("llama_ckpt"), K, _cycle_prompts()
    else:
        rng = random.Random(1)
        make, path, k = _deepseek, request.getfixturevalue("mtp_ckpt"), MTP_K
        prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (7, 3, 30)]
    expected = _greedy(make(path, spec=True, eager=True), prompts, 16)
    engine = make(path, spec=True, eager=True)
    runner = engine.core.worker.runner
    query_lens = graph_query_lens({layer.backend for layer in runner.attn_layers}, runner.num_speculative_tokens)
    assert query_lens == (1, 1 + k)
    graphs = DecodeGraphRunner(runner.model, runner._builders, runner._layer_builder, runner.kv_caches,
                               runner.device, runner.block_size, [1, 2, 4, 8], 256, query_lens=query_lens)
    graphs.capture()
    assert set(graphs.graphs) == {(q, b) for q in (1, 1 + k) for b in (1, 2, 4, 8)}
    runner.cuda_graphs = graphs
    _assert_same(_greedy(engine, prompts, 16), expected)
    assert graphs.replays_by_query_len[1 + k] > 0
