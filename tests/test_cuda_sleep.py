"""`LLM.sleep` / `wake_up` on a GPU (skipped without one): level 1 returns the KV cache's device memory and
level 2 the weights' too; after waking, decode steps replayed from recaptured CUDA graphs give the same
greedy tokens as before."""

from __future__ import annotations

import gc

import pytest
import torch

from keel import LLM, SamplingParams, TokensPrompt
from keel.testing.checkpoints import make_checkpoint

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_checkpoint("llama", tmp_path_factory.mktemp("cuda-sleep") / "llama", head_dim=64,
                           num_hidden_layers=3, vocab_size=512, max_position_embeddings=512)
    return LLM(str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256, platform="cuda",
               plugins=["platform-cuda", "attention-flash", "models-llama"], attention_backend="triton_flash",
               max_num_seqs=8, num_kv_blocks=2048)


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_returns_device_memory_and_wake_up_restores(llm, level):
    prompts = [TokensPrompt(prompt_token_ids=list(range(3, 3 + n))) for n in (5, 40, 100)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = llm.llm_engine.core.worker.runner
    kv_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    awake = _allocated()
    llm.sleep(level)
    freed = awake - _allocated()
    assert freed >= 0.9 * (kv_bytes + (weight_bytes if level == 2 else 0))
    llm.wake_up()
    assert llm.llm_engine.core.worker.runner.cuda_graphs is not None  # recaptured over the new cache
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert after == before
