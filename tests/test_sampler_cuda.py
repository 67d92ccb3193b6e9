"""On a GPU: the hash noise, hence every seeded token, is bit-identical to the CPU's."""

from __future__ import annotations

import pytest
import torch

from keel.engine.sampling_params import SamplingParams
from keel.layers.sampler import Sampler, random_uniform
from keel.layers.sampling_metadata import SamplingMetadata

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def test_uniforms_match_cpu_bitwise() -> None:
    seeds = torch.tensor([0, -1, 2**62 + 5, 123456789])
    step = torch.tensor([0, 7, 1, 1000])
    cpu = random_uniform(seeds, step, 4096)
    gpu = random_uniform(seeds.cuda(), step.cuda(), 4096).cpu()
    assert torch.equal(cpu, gpu)


def test_seeded_tokens_match_cpu() -> None:
    torch.manual_seed(0)
    vocab, b = 1000, 16
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=i) for i in range(b)]
    logits = torch.randn(b, vocab) * 3

    def run(device: str) -> list[int]:
        meta = SamplingMetadata.build(
            params, [[1, 2]] * b, [[3]] * b, list(range(b)), vocab, device, [set()] * b
        )
        return Sampler()(logits.to(device), meta).sampled_token_ids.tolist()

    assert run("cpu") == run("cuda")


def test_compiled_noise_matches_eager_bitwise() -> None:
    from keel.layers.sampler import _noise_for, log_exponential_noise

    seeds = torch.arange(5, device="cuda") * 1_000_003 - 2
    step = torch.tensor([0, 1, 2, 3, 500], device="cuda")
    compiled = _noise_for(torch.device("cuda"))(seeds, step, 3001)
    eager = log_exponential_noise(seeds, step, 3001)
    torch.testing.assert_close(compiled, eager, rtol=2e-6, atol=0)
    assert torch.equal(
        random_uniform(seeds, step, 3001), torch.compile(random_uniform, dynamic=True)(seeds, step, 3001)
    )
