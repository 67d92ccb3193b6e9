"""Fidelity harness: drive a keel engine and compare with transformers' greedy decoding.

Model and backend plugins (in-repo or third-party) use it to show "greedy tokens equal, logprobs within
tolerance" the same way: `run_requests` submits prompts (together or staggered) and runs the engine to
completion; `hf_greedy` is a plain full-recompute greedy loop in transformers (no cache, no padding: the
simplest possible reference); `assert_matches_hf` compares the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def load_hf(model_or_path: Any, device: str = "cpu") -> torch.nn.Module:
    """A transformers model as is, or loaded from a checkpoint directory in float32, eager attention."""
    if isinstance(model_or_path, torch.nn.Module):
        return model_or_path
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_or_path, dtype=torch.float32, attn_implementation="eager"
    ).to(device).eval()


def hf_greedy(
    model_or_path: Any, prompt: Sequence[int], max_tokens: int, *, device: str = "cpu"
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-softmax logprobs from transformers, recomputing the full sequence
    each step. `model_or_path`: a loaded model (kept on its device) or a checkpoint directory (loaded in
    float32 with eager attention on `device`)."""
    model = load_hf(model_or_path, device)
    dev = next(model.parameters()).device
    ids = list(prompt)
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids], device=dev)).logits[0, -1].float()
            tok = int(logits.argmax())
            tokens.append(tok)
            logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
            ids.append(tok)
    return tokens, logprobs


def run_requests(engine: Any, prompts: Sequence[Sequence[int]], params: Any, *, stagger: int = 0,
                 prefix: str = "") -> dict[str, Any]:
    """Submit token-id prompts to an `LLMEngine` (all at once, or one every `stagger` steps) and step it
    until everything finished. `params`: one SamplingParams for all, or a list (cycled over prompts).
    Returns request id (`prefix` + index) -> final RequestOutput."""
    results: dict[str, Any] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and (stagger == 0 or step % stagger == 0):
            i, p = pending.pop(0)
            per = params[i % len(params)] if isinstance(params, list | tuple) else params
            engine.add_request(f"{prefix}{i}", {"prompt_token_ids": list(p)}, per)
            if stagger:
                break
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        step += 1
    return results


def run_with_abort(engine: Any, prompts: Sequence[Sequence[int]], params: Any, abort_id: str, at_step: int,
                   max_steps: int = 200) -> dict[str, Any]:
    """Submit token-id prompts (ids "0", "1", ...), abort `abort_id` before step `at_step` -- with async
    scheduling, while steps of it are in flight -- and step until done. Returns id -> finished output."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": list(p)}, params)
    done: dict[str, Any] = {}
    for step in range(max_steps):
        if step == at_step:
            engine.abort_request(abort_id)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    return done


def finish_summary(results: dict[str, Any]) -> dict[str, list]:
    """Per request: (token ids, finish reason, stop reason) of each completion, for equality checks."""
    return {rid: [(list(c.token_ids), c.finish_reason, c.stop_reason) for c in r.outputs]
            for rid, r in results.items()}


def assert_logprobs_close(got: dict[str, Any], want: dict[str, Any], tol: float = 1e-4) -> None:
    """Same logprob tokens and ranks per position, values within `tol` (float32: a different batch
    composition may round differently)."""
    for rid in want:
        for a, b in zip(got[rid].outputs, want[rid].outputs, strict=True):
            for da, db in zip(a.logprobs or [], b.logprobs or [], strict=True):
                assert da.keys() == db.keys(), rid
                assert all(abs(da[t].logprob - db[t].logprob) < tol and da[t].rank == db[t].rank for t in da), rid


def assert_spec_async_identical(make_engine: Any, prompts: Sequence[Sequence[int]], params: Any,
                                stagger: int = 0) -> tuple[Any, dict[str, Any]]:
    """`make_engine(spec, async_scheduling)` -> LLMEngine. Plain decoding, speculative decoding, and
    speculative decoding with async scheduling give identical outputs (logprobs within 1e-4); the async
    engine accepted drafts and freed every block. Returns the async engine and its outputs."""
    plain = run_requests(make_engine(False, False), prompts, params, stagger=stagger)
    spec = run_requests(make_engine(True, False), prompts, params, stagger=stagger)
    engine = make_engine(True, True)
    assert engine.core.async_scheduling
    got = run_requests(engine, prompts, params, stagger=stagger)
    assert finish_summary(spec) == finish_summary(plain)
    assert finish_summary(got) == finish_summary(plain)
    assert_logprobs_close(got, plain)
    m = engine.get_metrics()
    assert 0 < m["spec_decode_num_accepted_tokens_total"] <= m["spec_decode_num_draft_tokens_total"]
    assert m["kv_cache_usage"] == 0.0 and not engine.has_unfinished_requests()
    return engine, got


def greedy_tokens_and_logprobs(engine: Any, prompts: Sequence[Sequence[int]],
                               max_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens (ignore_eos) and each token's logprob per prompt, all submitted at once."""
    from keel.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = [run_requests(engine, prompts, params)[str(i)].outputs[0] for i in range(len(prompts))]
    return ([list(o.token_ids) for o in outs],
            [[d[t].logprob for d, t in zip(o.logprobs, o.token_ids)] for o in outs])


def assert_matches_hf(model_or_path: Any, prompts: Sequence[Sequence[int]], results: dict[str, Any],
                      max_tokens: int, *, atol: float = 1e-4, prefix: str = "", device: str = "cpu") -> None:
    """Every request's greedy tokens equal transformers'; the sampled tokens' logprobs (requests made
    with `logprobs=0` or more) are within `atol` of transformers' log-softmax."""
    model = load_hf(model_or_path, device)
    for i, p in enumerate(prompts):
        out = results[f"{prefix}{i}"].outputs[0]
        ref_tokens, ref_lps = hf_greedy(model, p, max_tokens)
        assert list(out.token_ids) == ref_tokens, f"prompt {i}: greedy tokens differ"
        if out.logprobs is not None:
            got = [out.logprobs[j][t].logprob for j, t in enumerate(out.token_ids)]
            worst = max(abs(a - b) for a, b in zip(got, ref_lps))
            assert worst < atol, f"prompt {i}: logprob differs by {worst:.2e} (tolerance {atol:.0e})"


def assert_close_to_hf(model_or_path: Any, prompts: Sequence[Sequence[int]], results: dict[str, Any], *,
                       atol: float, min_margin: float, prefix: str = "", device: str = "cpu") -> dict[str, float]:
    """For lossy paths (quantization): transformers follows each request's own output tokens (one
    forward over prompt + output), so a near-tie cannot derail the rest of the comparison. Every token
    the engine chose must be transformers' argmax where transformers' top-2 logit margin exceeds
    `min_margin`, and its logprob must be within `atol` of transformers' (requests made with
    `logprobs=0` or more). Returns {"worst_logprob_diff", "near_ties"} for the test to report."""
    model = load_hf(model_or_path, device)
    dev = next(model.parameters()).device
    worst, near_ties = 0.0, 0
    for i, p in enumerate(prompts):
        out = results[f"{prefix}{i}"].outputs[0]
        tokens = list(out.token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([list(p) + tokens], device=dev)).logits[0].float()
        steps = logits[len(p) - 1 : len(p) - 1 + len(tokens)]  # [len(tokens), vocab]: predicts each token
        logprobs = torch.log_softmax(steps, -1)
        top2 = steps.topk(2, dim=-1).values
        for j, t in enumerate(tokens):
            clear = float(top2[j, 0] - top2[j, 1]) > min_margin
            if not clear:
                near_ties += 1
            assert not clear or int(steps[j].argmax()) == t, (
                f"prompt {i} step {j}: token {t} is not transformers' clear argmax {int(steps[j].argmax())}"
            )
            if out.logprobs is not None:
                diff = abs(out.logprobs[j][t].logprob - float(logprobs[j, t]))
                worst = max(worst, diff)
                assert diff < atol, f"prompt {i} step {j}: logprob differs by {diff:.2e} (tolerance {atol:.0e})"
    return {"worst_logprob_diff": worst, "near_ties": near_ties}
