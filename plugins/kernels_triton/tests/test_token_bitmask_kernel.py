"""kernels-triton's apply_token_bitmask against the torch reference and a plain Python one, on fresh
inputs: vocab sizes that are not a multiple of 32 (a partial last word) or of the kernel's tile, words
with the sign bit set, bitmask rows in any order naming some of the logits rows (the rest untouched,
bit for bit), poisoned (NaN) logits in masked rows, and bf16 logits."""

from __future__ import annotations

import pytest
import torch
from keel_kernels_triton.token_bitmask import BLOCK, TritonApplyTokenBitmask

from keel.layers.token_bitmask import TokenBitmask, apply_token_bitmask
from keel.structured_output.backend import bitmask_width

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_bitmask(gen: torch.Generator, rows: int, vocab: int, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 [rows, words] packed as grammar libraries write it, bool [rows, vocab] allowed)."""
    allowed = torch.rand(rows, vocab, generator=gen) < p
    words = bitmask_width(vocab)
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    packed = (padded.view(rows, words, 32) << torch.arange(32)).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed, allowed


@pytest.mark.parametrize("vocab", [1, 33, 1000, BLOCK + 5, 3 * BLOCK - 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen).to(dtype)
    logits[3, :] = float("nan")  # a poisoned row: masked entries must become -inf, others stay as they were
    bitmask, allowed = random_bitmask(gen, 4, vocab, 0.4)
    bitmask[0], allowed[0] = -1, True  # a row allowing everything (all words -1): untouched
    rows = torch.tensor([5, 0, 3, 2])  # 1 and 4 have no mask
    want = apply_token_bitmask(logits.clone(), bitmask, rows)
    for i, r in enumerate(rows.tolist()):  # the plain definition
        assert torch.equal(want[r] == float("-inf"), ~allowed[i] | (logits[r] == float("-inf")))
    got = logits.to(DEVICE)
    out = TritonApplyTokenBitmask()(got, bitmask.to(DEVICE), rows.to(DEVICE))
    assert out is got  # in place
    torch.testing.assert_close(got.cpu(), want, equal_nan=True, rtol=0, atol=0)
    for r in (1, 4):
        assert torch.equal(got[r].cpu(), logits[r])


def test_empty_and_invalid_bitmasks():
    op = TritonApplyTokenBitmask()
    logits = torch.randn(2, 40, device=DEVICE)
    before = logits.clone()
    op(logits, torch.zeros(0, 2, dtype=torch.int32, device=DEVICE), torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="covering 40 tokens"):
        op(logits, torch.zeros(1, 1, dtype=torch.int32, device=DEVICE), torch.zeros(1, dtype=torch.int64, device=DEVICE))


def test_layer_runs_the_bound_op_or_the_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=gen)
    bitmask, _ = random_bitmask(gen, 2, 70, 0.5)
    rows = torch.tensor([2, 0])
    layer = TokenBitmask()
    want = layer(logits.clone(), bitmask, rows)  # nothing bound: the torch reference
    layer.bound_ops = {"apply_token_bitmask": TritonApplyTokenBitmask()}
    got = layer(logits.to(DEVICE), bitmask.to(DEVICE), rows.to(DEVICE))
    assert torch.equal(got.cpu(), want)
