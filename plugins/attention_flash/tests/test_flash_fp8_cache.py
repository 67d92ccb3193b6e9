"""FP8 (e4m3) KV cache in triton_flash, interpreted on the CPU: the cache is written through torch's
rounding (then copied as bytes) and read back as value * the layer's scale, so its tokens and logprobs
equal torch_paged's fp8 path (float32, 1e-4) -- with unit scales and with per-layer k_scale / v_scale
from the checkpoint (vLLM's `self_attn.k_scale` names) -- through chunked prefill next to decodes. Kept
tiny: the interpreter runs every program in Python."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.checkpoints import make_checkpoint
from keel.testing.fidelity import run_requests

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA runs cover this compiled")

PARAMS = SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 7, 99], list(range(3, 22))]


def engine(path, backend):
    plugin = "attention-flash" if backend == "triton_flash" else "attention-torch"
    return LLMEngine.from_engine_args(EngineArgs(
        model=str(path), skip_tokenizer_init=True, dtype="float32", block_size=16, max_model_len=64,
        plugins=["platform-cpu", plugin, "models-llama"], attention_backend=backend, kv_cache_dtype="fp8",
        max_num_batched_tokens=24,  # the 19-token prompt is prefilled in two chunks next to a decode
    ))


def tokens_and_logprobs(results):
    return {k: (list(o.outputs[0].token_ids), [d[t].logprob for d, t in zip(o.outputs[0].logprobs,
                                                                            o.outputs[0].token_ids)])
            for k, o in results.items()}


@pytest.mark.parametrize("scales", [None, (0.05, 0.02)], ids=["unit-scales", "checkpoint-scales"])
def test_triton_flash_fp8_cache_matches_the_torch_reference(tmp_path, scales):
    path = make_checkpoint("llama", tmp_path / "llama", head_dim=64, num_hidden_layers=1)
    if scales is not None:  # |k| / 0.05 spans much of e4m3's range: a unit scale would round differently
        w = load_file(str(path / "model.safetensors"))
        w["model.layers.0.self_attn.k_scale"] = torch.tensor(scales[0])
        w["model.layers.0.self_attn.v_scale"] = torch.tensor(scales[1])
        save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    flash = engine(path, "triton_flash")
    attn = flash.core.worker.runner.attn_layers[0]
    assert attn.backend.name == "triton_flash" and flash.core.worker.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert float(attn.k_scale) == pytest.approx(scales[0] if scales else 1.0)
    got = tokens_and_logprobs(run_requests(flash, PROMPTS, PARAMS))
    want = tokens_and_logprobs(run_requests(engine(path, "torch_paged"), PROMPTS, PARAMS))
    for key, (toks, lps) in want.items():
        assert got[key][0] == toks
        assert max(abs(a - b) for a, b in zip(got[key][1], lps)) < 1e-4
