"""End to end on the CPU platform with attention_backend="triton_flash" (kernels interpreted): greedy
tokens and logprobs of a tiny random Llama equal transformers' (float32). Kept tiny: the interpreter
runs every Triton program in Python."""

from __future__ import annotations

import pytest
import torch

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.checkpoints import make_checkpoint

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA runs cover this compiled")


def _hf_greedy(path, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids, toks, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            tok = int(logits.argmax())
            toks.append(tok)
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            ids.append(tok)
    return toks, lps


def test_triton_flash_engine_matches_transformers(tmp_path):
    path = make_checkpoint("llama", tmp_path / "llama", head_dim=64, num_hidden_layers=1)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(path), skip_tokenizer_init=True, dtype="float32", block_size=16, max_model_len=64,
        plugins=["platform-cpu", "attention-flash", "models-llama"], attention_backend="triton_flash",
        max_num_batched_tokens=24,  # the 19-token prompt is prefilled in two chunks next to a decode
    ))
    assert {layer.backend.name for layer in engine.core.worker.runner.attn_layers} == {"triton_flash"}
    prompts = [[5, 17, 42, 7, 99], list(range(3, 22))]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0]
    for i, p in enumerate(prompts):
        tokens, logprobs = _hf_greedy(path, p, 4)
        got = results[f"r{i}"]
        assert list(got.token_ids) == tokens
        ours = [next(iter(d.values())).logprob for d in got.logprobs]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=1e-4, rtol=0)
