"""Embedding (pooling) requests on a GPU against transformers on the same GPU (skipped without one):
the CUDA platform's paths -- async scheduling (pooling requests take no output placeholder), staged
inputs, Triton attention, decode graphs captured for the generation side -- with prompts chunked over
steps and batched with each other."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

from keel.config import EngineArgs
from keel.engine.async_llm import AsyncLLM
from keel.engine.pooling_params import PoolingParams
from keel.testing.checkpoints import make_checkpoint

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
PLUGINS = ["platform-cuda", "attention-flash", "models-llama"]


@pytest.mark.parametrize("attention_backend", ["triton_flash", "torch_paged"])
def test_embeddings_equal_transformers_on_cuda(tmp_path, attention_backend):
    from transformers import AutoModel

    path = make_checkpoint("llama-embed", tmp_path / "embed", head_dim=64, num_hidden_layers=3, vocab_size=512,
                           max_position_embeddings=512)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 40, 130, 17, 64, 3)]
    plugins = [*PLUGINS, "attention-torch"] if attention_backend == "torch_paged" else PLUGINS
    engine = AsyncLLM.from_engine_args(EngineArgs(
        model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256, plugins=plugins,
        platform="cuda", attention_backend=attention_backend, max_num_batched_tokens=64, max_num_seqs=8,
        gpu_memory_utilization=0.3))

    async def run():
        async def one(i, ids):
            return [o async for o in engine.encode({"prompt_token_ids": ids}, PoolingParams(), f"e{i}")][-1]
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        outs = asyncio.run(run())
    finally:
        engine.shutdown()
    model = AutoModel.from_pretrained(path, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        for ids, out in zip(prompts, outs):
            hidden = model(torch.tensor([ids], device="cuda")).last_hidden_state[0, -1]
            want = torch.nn.functional.normalize(hidden, dim=-1).cpu().numpy()
            np.testing.assert_allclose(out.outputs.data.numpy(), want, atol=2e-3)
