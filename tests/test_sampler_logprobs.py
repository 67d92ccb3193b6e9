"""Logprobs: raw model distribution, sampled token in column 0 with its rank, top-k after it."""

from __future__ import annotations

import pytest
import torch

from keel.engine.sampling_params import SamplingParams
from keel.layers.sampler import Sampler, compute_logprobs
from keel.layers.sampling_metadata import SamplingMetadata


def _build(params: list[SamplingParams], vocab: int) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params=params, output_token_ids=[[1]] * n, prompt_token_ids=[[2]] * n, seeds=list(range(n)),
        vocab_size=vocab, device="cpu", stop_token_ids_for_min_tokens=[set()] * n,
    )


def test_compute_logprobs_columns_and_ranks() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    ids, lps, ranks = compute_logprobs(logits, torch.tensor([3, 2]), 2)
    ref = logits.double().log_softmax(-1)
    assert ids.tolist() == [[3, 1, 2], [2, 2, 3]]
    assert ranks.tolist() == [[4, 1, 2], [1, 1, 2]]
    expected = ref.gather(1, ids).float()
    torch.testing.assert_close(lps, expected)
    assert ids.dtype == torch.int64 and ranks.dtype == torch.int64 and lps.dtype == torch.float32


def test_compute_logprobs_zero_top_and_bad_count() -> None:
    ids, _, ranks = compute_logprobs(torch.tensor([[0.0, 1.0]]), torch.tensor([0]), 0)
    assert ids.tolist() == [[0]] and ranks.tolist() == [[2]]
    with pytest.raises(ValueError, match="num_logprobs"):
        compute_logprobs(torch.tensor([[0.0, 1.0]]), torch.tensor([0]), 3)


def test_sampler_logprobs_are_raw_and_include_unlikely_sampled_token() -> None:
    torch.manual_seed(0)
    vocab = 20
    logits = torch.randn(3, vocab)
    low = int(logits[0].argmin())  # forced by logit_bias: the raw distribution ranks it last
    params = [
        SamplingParams(temperature=0.0, logit_bias={low: 100.0}, logprobs=2),
        SamplingParams(temperature=0.3, repetition_penalty=1.7, logprobs=4),
        SamplingParams(),  # asked for none; still gets columns, which the runner ignores
    ]
    out = Sampler()(logits, _build(params, vocab))
    assert out.logprobs is not None and out.logprob_token_ids is not None and out.ranks is not None
    assert out.logprobs.shape == (3, 5) and out.ranks.shape == (3, 5)
    assert out.sampled_token_ids[0] == low
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert out.ranks[0, 0] == vocab
    raw = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.logprob_token_ids))
    top = raw.topk(4, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    assert out.ranks[:, 1:].tolist() == [[1, 2, 3, 4]] * 3
    expected_rank = (raw > raw.gather(1, out.sampled_token_ids[:, None])).sum(-1) + 1
    assert torch.equal(out.ranks[:, 0], expected_rank)


def test_no_logprobs_requested_returns_none() -> None:
    out = Sampler()(torch.randn(2, 6), _build([SamplingParams(), SamplingParams(temperature=0.0)], 6))
    assert out.logprob_token_ids is None and out.logprobs is None and out.ranks is None


def test_prompt_logprobs_use_next_prompt_tokens() -> None:
    torch.manual_seed(1)
    logits = torch.randn(5, 11)  # logits at 5 prompt positions
    next_tokens = torch.tensor([4, 0, 10, 3, 3])
    ids, lps, _ = compute_logprobs(logits, next_tokens, 1)
    assert torch.equal(ids[:, 0], next_tokens)
    torch.testing.assert_close(lps[:, 0], logits.log_softmax(-1)[torch.arange(5), next_tokens])
