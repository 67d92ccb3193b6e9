"""SamplingMetadata.build: per-row tensors, skip flags, counts and masks."""

from __future__ import annotations

import pytest
import torch

from keel.engine.sampling_params import SamplingParams
from keel.layers.sampling_metadata import SamplingMetadata


def _build(params: list[SamplingParams], outputs: list[list[int]], stops: list[set[int]] | None = None,
           vocab: int = 6) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params=params, output_token_ids=outputs, prompt_token_ids=[[5, 5, 1]] * n,
        seeds=[10 + i for i in range(n)], vocab_size=vocab, device=torch.device("cpu"),
        stop_token_ids_for_min_tokens=stops if stops is not None else [set()] * n,
    )


def test_plain_batch_skips_everything() -> None:
    meta = _build([SamplingParams(), SamplingParams(seed=3)], [[], [1, 2]])
    assert meta.all_random and not meta.all_greedy
    assert meta.no_penalties and meta.no_top_k and meta.no_top_p and meta.no_min_p
    assert meta.max_num_logprobs is None
    assert meta.output_token_counts is None and meta.prompt_token_mask is None
    assert meta.min_tokens_mask is None and meta.logit_bias is None
    assert meta.top_k.tolist() == [6, 6] and meta.step.tolist() == [0, 2]
    assert meta.seeds.tolist() == [10, 11]  # the engine's seeds are used as given
    assert meta.seeds.dtype == torch.int64 and meta.temperature.dtype == torch.float32


def test_flags_tensors_and_counts() -> None:
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(top_k=2, top_p=0.5, min_p=0.1,
              frequency_penalty=0.5, logprobs=1, min_tokens=2)]
    meta = _build(params, [[1, 1, 4], [3]], stops=[{0}, {0, 2, 99}])
    assert not meta.all_random and not meta.all_greedy
    assert not (meta.no_penalties or meta.no_top_k or meta.no_top_p or meta.no_min_p)
    assert meta.max_num_logprobs == 3
    assert meta.top_k.tolist() == [6, 2]
    assert meta.output_token_counts is not None and meta.prompt_token_mask is not None
    assert meta.output_token_counts.tolist() == [[0, 2, 0, 0, 1, 0], [0, 0, 0, 1, 0, 0]]
    assert meta.prompt_token_mask.tolist() == [[False, True, False, False, False, True]] * 2
    # Row 0 has no min_tokens; row 1 is under it, and the out-of-vocab stop id 99 is ignored.
    assert meta.min_tokens_mask is not None
    assert meta.min_tokens_mask.tolist() == [[False] * 6, [True, False, True, False, False, False]]


def test_length_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="one entry per request"):
        SamplingMetadata.build([SamplingParams()], [[]], [[1]], [1, 2], 6, "cpu", [set()])
