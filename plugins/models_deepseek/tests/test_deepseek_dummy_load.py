"""load_format="dummy" processes weights exactly like a checkpoint load (MLA absorbs kv_b_proj), so a
DeepSeek model with random weights runs through the engine -- and replacing its weights by hand then
calling process_weights_after_loading gives the checkpoint model's outputs."""

from __future__ import annotations

import torch
from deepseek_test_utils import make_deepseek_checkpoint
from safetensors.torch import load_file

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine


def _greedy(engine, prompt):
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4,
                                                                         ignore_eos=True, logprobs=0))
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    return out.outputs[0]


def test_dummy_weights_run_and_reloaded_weights_match(tmp_path):
    path = make_deepseek_checkpoint(2, tmp_path / "v2")
    args = {"model": str(path), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 4, "max_model_len": 64}
    real = LLMEngine.from_engine_args(EngineArgs(**args))
    # no prefix caching: KV computed with the dummy weights must not serve the reloaded model
    dummy = LLMEngine.from_engine_args(EngineArgs(**args, load_format="dummy", enable_prefix_caching=False))
    prompt = [5, 17, 42, 9, 3]
    out = _greedy(dummy, prompt)
    assert len(out.token_ids) == 4 and all(torch.isfinite(torch.tensor(
        [d[t].logprob for d, t in zip(out.logprobs, out.token_ids)])))
    model = dummy.core.worker.runner.model
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    model.load_weights(tensors.items())
    model.process_weights_after_loading()
    assert _greedy(dummy, prompt).token_ids == _greedy(real, prompt).token_ids
