"""Sampler: greedy, filters against a float64 reference, penalties, min_tokens, statistics."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from keel.engine.sampling_params import SamplingParams
from keel.layers.sampler import Sampler, apply_top_k_top_p
from keel.layers.sampling_metadata import SamplingMetadata


def make_meta(
    params: Sequence[SamplingParams],
    vocab: int,
    outputs: Sequence[Sequence[int]] | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    seeds: Sequence[int] | None = None,
    stops: Sequence[set[int]] | None = None,
) -> SamplingMetadata:
    b = len(params)
    return SamplingMetadata.build(
        params=list(params),
        output_token_ids=list(outputs) if outputs is not None else [[] for _ in range(b)],
        prompt_token_ids=list(prompts) if prompts is not None else [[0] for _ in range(b)],
        seeds=list(seeds) if seeds is not None else [p.seed or 1000 + i for i, p in enumerate(params)],
        vocab_size=vocab,
        device="cpu",
        stop_token_ids_for_min_tokens=list(stops) if stops is not None else [set() for _ in range(b)],
    )


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """float64, one row, written independently of the sampler: temperature, min_p, top_k, top_p."""
    x = logits.to(torch.float64) / p.temperature
    if p.min_p > 0:
        probs = x.softmax(-1)
        x = torch.where(probs >= p.min_p * probs.max(), x, float("-inf"))
    if p.top_k > 0:
        kth = x.sort(descending=True).values[min(p.top_k, x.numel()) - 1]
        x = torch.where(x >= kth, x, float("-inf"))
    if p.top_p < 1:
        probs = x.softmax(-1)
        mass = 0.0
        keep = torch.zeros_like(x, dtype=torch.bool)
        for i in probs.argsort(descending=True).tolist():
            if mass >= p.top_p:
                break
            keep[i] = True
            mass += probs[i].item()
        x = torch.where(keep, x, float("-inf"))
    return x.softmax(-1)


FILTER_CASES = [
    SamplingParams(),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.0, top_k=3),
    SamplingParams(top_p=0.6),
    SamplingParams(temperature=0.7, top_k=10, top_p=0.8),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=1.3, min_p=0.05, top_k=7, top_p=0.9),
    SamplingParams(top_k=1),
    SamplingParams(top_k=1000),  # larger than the vocabulary
]


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 40)
    meta = make_meta([SamplingParams(temperature=0.0)] * 6, 40)
    assert meta.all_greedy
    out = Sampler()(logits, meta)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64 and out.logprobs is None


def test_greedy_rows_in_mixed_batch_are_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 40)
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.0, top_k=2),
              SamplingParams(top_p=0.3)]
    out = Sampler()(logits, make_meta(params, 40))
    assert out.sampled_token_ids[0] == logits[0].argmax() and out.sampled_token_ids[2] == logits[2].argmax()


def test_processed_probs_match_float64_reference() -> None:
    torch.manual_seed(2)
    vocab = 50
    logits = torch.randn(len(FILTER_CASES), vocab) * 2
    meta = make_meta(FILTER_CASES, vocab)
    probs = Sampler().compute_probs(logits, meta)
    for row, p in enumerate(FILTER_CASES):
        ref = reference_probs(logits[row], p)
        torch.testing.assert_close(probs[row].double(), ref, atol=1e-5, rtol=1e-4)
        assert torch.equal(probs[row] > 0, ref > 0), f"support differs for {p}"


def test_greedy_probs_are_one_hot() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0]])
    probs = Sampler().compute_probs(logits, make_meta([SamplingParams(temperature=0.0)], 3))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0]]))


def test_top_k_keeps_ties_and_top_p_keeps_at_least_one() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0], [5.0, 0.0, 0.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([1, 4]), torch.tensor([1.0, 1e-6]))
    assert torch.isinf(out[0]).tolist() == [True, False, False, True]
    assert torch.isinf(out[1]).tolist() == [False, True, True, True]


@pytest.mark.parametrize("vary", ["seed", "step"])
def test_empirical_frequencies_match_filtered_distribution(vary: str) -> None:
    """Many draws (distinct seeds in one batch, or one seed over many steps) follow compute_probs."""
    torch.manual_seed(3)
    vocab, n = 12, 20000
    p = SamplingParams(temperature=0.8, top_k=8, top_p=0.95, min_p=0.02)
    logits = (torch.randn(1, vocab) * 1.5).expand(n, vocab)
    meta = make_meta([p] * n, vocab, seeds=list(range(n)) if vary == "seed" else [77] * n)
    if vary == "step":
        meta.step = torch.arange(n)
    sampled = Sampler()(logits, meta).sampled_token_ids
    freq = torch.bincount(sampled, minlength=vocab).double() / n
    expected = reference_probs(logits[0], p)
    assert torch.all(freq[expected == 0] == 0)
    tol = 4.5 * torch.sqrt(expected * (1 - expected) / n) + 1e-3
    assert torch.all((freq - expected).abs() <= tol), (freq, expected)


def test_penalties_hand_computed() -> None:
    # token 0 in the prompt, tokens 1 (once) and 3 (twice) in the output, token 2 unseen
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    meta = make_meta([p], 4, outputs=[[1, 3, 3]], prompts=[[0]])
    processed = Sampler().apply_logits_processors(logits, meta)
    # 0: 2/2 = 1;  1: -1*2 - 0.5*1 - 0.25 = -2.75;  2: untouched;  3: 3/2 - 0.5*2 - 0.25 = 0.25
    torch.testing.assert_close(processed, torch.tensor([[1.0, -2.75, 0.5, 0.25]]))


def test_penalties_apply_to_greedy_and_only_to_their_row() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    params = [SamplingParams(temperature=0.0, presence_penalty=0.5), SamplingParams(temperature=0.0)]
    out = Sampler()(logits, make_meta(params, 3, outputs=[[0], [0]]))
    assert out.sampled_token_ids.tolist() == [1, 0]


def test_logit_bias_shifts_logits() -> None:
    logits = torch.zeros(2, 5)
    params = [SamplingParams(temperature=0.0, logit_bias={3: 10.0}), SamplingParams(temperature=0.0)]
    meta = make_meta(params, 5)
    processed = Sampler().apply_logits_processors(logits, meta)
    assert processed[0].tolist() == [0, 0, 0, 10, 0] and processed[1].tolist() == [0] * 5
    with pytest.raises(ValueError, match="logit_bias token id 9"):
        make_meta([SamplingParams(logit_bias={9: 1.0})], 5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_stop_tokens(temperature: float) -> None:
    eos, stop = 0, 4
    logits = torch.tensor([[10.0, 0.0, 0.0, 0.0, 9.0, 0.0]]).expand(64, 6)
    p = SamplingParams(temperature=temperature, min_tokens=3)
    # rows 0..31 have 2 output tokens (< min_tokens), rows 32..63 have 3 (the ban is lifted)
    outputs = [[1, 2]] * 32 + [[1, 2, 3]] * 32
    meta = make_meta([p] * 64, 6, outputs=outputs, seeds=list(range(64)), stops=[{eos, stop}] * 64)
    sampled = Sampler()(logits, meta).sampled_token_ids
    assert not torch.isin(sampled[:32], torch.tensor([eos, stop])).any()
    assert (sampled[32:] == eos).float().mean() > 0.5


def test_input_logits_are_not_modified() -> None:
    torch.manual_seed(4)
    logits = torch.randn(2, 10)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5, top_p=0.5, min_p=0.1, min_tokens=2, logit_bias={1: 2.0}),
              SamplingParams(temperature=0.0, frequency_penalty=1.0)]
    Sampler()(logits, make_meta(params, 10, outputs=[[1], [2]], stops=[{0}, {0}]))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_rows_take_the_argmax_of_the_model_dtype_logits(monkeypatch, dtype):
    """A step whose rows are all plain greedy takes the argmax of the logits as the model computed them (no float32
    copy): the same tokens as the float32 path, ties included (many equal 16-bit maxima, the first wins), and no
    upcast at all. Anything that can move the argmax (a penalty, logit_bias, a ban, allowed_token_ids) or asks for
    logprobs takes the float32 path."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 300, generator=gen) * 3).to(dtype)
    logits[1, 7] = logits[1, 200] = logits[1].max() + 1  # a tie: token 7 first
    logits[2, :] = 0.5  # all equal
    params = [SamplingParams(temperature=0.0)] * 6
    want = Sampler()(logits.float(), make_meta(params, 300)).sampled_token_ids
    assert want[1] == 7 and want[2] == 0

    upcasts = []
    real_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        if torch.float32 in args or kwargs.get("dtype") == torch.float32:
            upcasts.append(self.shape)
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    got = Sampler()(logits, make_meta(params, 300))
    assert torch.equal(got.sampled_token_ids, want) and got.logprobs is None
    assert upcasts == []

    for other in (SamplingParams(temperature=0.0, repetition_penalty=1.3),
                  SamplingParams(temperature=0.0, logit_bias={3: 50.0}),
                  SamplingParams(temperature=0.0, logprobs=2)):
        meta = make_meta([other] * 6, 300, outputs=[[int(t)] for t in want])
        upcasts.clear()
        slow = Sampler()(logits, meta)
        assert upcasts, other
        monkeypatch.setattr(torch.Tensor, "to", real_to)
        assert torch.equal(slow.sampled_token_ids, Sampler()(logits.float(), meta).sampled_token_ids)
        monkeypatch.setattr(torch.Tensor, "to", spy)
