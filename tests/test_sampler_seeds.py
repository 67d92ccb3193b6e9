"""Seeded sampling: a request's tokens depend only on (seed, step), never on the rest of the batch."""

from __future__ import annotations

import torch

from keel.engine.sampling_params import SamplingParams
from keel.layers.sampler import Sampler, random_uniform
from keel.layers.sampling_metadata import SamplingMetadata


def _build(
    params: list[SamplingParams], seeds: list[int], outputs: list[list[int]], vocab: int
) -> SamplingMetadata:
    return SamplingMetadata.build(
        params=params,
        output_token_ids=outputs,
        prompt_token_ids=[[1, 2]] * len(params),
        seeds=seeds,
        vocab_size=vocab,
        device="cpu",
        stop_token_ids_for_min_tokens=[set()] * len(params),
    )


def test_uniforms_are_in_open_interval_and_look_uniform() -> None:
    u = random_uniform(torch.tensor([0, -1, 2**62, 12345]), torch.tensor([0, 5, 1, 99]), 50000)
    assert u.dtype == torch.float32 and u.shape == (4, 50000)
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (hist - 0.1).abs().max() < 0.005


def test_uniforms_depend_only_on_seed_and_step() -> None:
    a = random_uniform(torch.tensor([7, 8, 7]), torch.tensor([3, 3, 3]), 100)
    assert torch.equal(a[0], a[2]) and not torch.equal(a[0], a[1])
    b = random_uniform(torch.tensor([7]), torch.tensor([4]), 100)
    assert not torch.equal(a[0], b[0])
    assert (a[0] - a[1]).abs().mean() > 0.2  # unrelated streams, not shifted copies


def test_same_seed_same_tokens_regardless_of_batch_composition_and_position() -> None:
    torch.manual_seed(0)
    vocab = 64
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    target_logits = torch.randn(vocab)
    others = [SamplingParams(temperature=0.0), SamplingParams(top_k=5), SamplingParams(presence_penalty=1.0),
              SamplingParams(min_p=0.1, seed=9)]
    sampler = Sampler()
    for step in range(5):
        out = [0] * step
        alone = sampler(target_logits[None], _build([target], [1234], [out], vocab)).sampled_token_ids[0]
        for pos in range(len(others) + 1):
            params = [*others[:pos], target, *others[pos:]]
            logits = torch.randn(len(params), vocab)
            logits[pos] = target_logits
            seeds = [s + 1 for s in range(len(params))]
            seeds[pos] = 1234
            outputs = [[3] * (i % 3) for i in range(len(params))]
            outputs[pos] = out
            got = sampler(logits, _build(params, seeds, outputs, vocab)).sampled_token_ids[pos]
            assert got == alone, (step, pos)


def test_same_seed_gives_same_sequence_and_different_seeds_differ() -> None:
    torch.manual_seed(1)
    vocab, steps = 32, 40
    logits = torch.randn(steps, vocab)
    sampler = Sampler()

    def run(seed: int) -> list[int]:
        toks: list[int] = []
        for t in range(steps):
            meta = _build([SamplingParams(seed=seed)], [seed], [list(toks)], vocab)
            toks.append(int(sampler(logits[t][None], meta).sampled_token_ids[0]))
        return toks

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_large_and_negative_seeds_are_accepted() -> None:
    meta = _build([SamplingParams(seed=2**70 + 3), SamplingParams(seed=-5)], [2**70 + 3, -5], [[], []], 8)
    assert meta.seeds.tolist() == [3, -5]
    Sampler()(torch.randn(2, 8), meta)
