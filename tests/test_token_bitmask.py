"""The device-side bitmask application against a plain Python reference: odd vocab sizes (a partial last
word), sign bits, rows in any order, masked in place, other rows untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from keel.layers.token_bitmask import apply_token_bitmask, unpack_token_bitmask
from keel.structured_output.backend import bitmask_width


def pack(allowed: list[list[bool]], vocab: int) -> torch.Tensor:
    words = bitmask_width(vocab)
    out = torch.zeros(len(allowed), words, dtype=torch.int64)
    for r, row in enumerate(allowed):
        for t, ok in enumerate(row):
            if ok:
                out[r, t // 32] |= 1 << (t % 32)
    # Two's complement int32, as the grammar libraries write it.
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 511])
def test_unpack_matches_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    allowed = (torch.rand(3, vocab, generator=gen) < 0.5).tolist()
    allowed[0] = [True] * vocab  # every bit set: the words are -1
    got = unpack_token_bitmask(pack(allowed, vocab), vocab)
    assert got.tolist() == allowed


def test_apply_masks_only_the_named_rows():
    vocab, gen = 77, torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=gen, dtype=torch.float32)
    before = logits.clone()
    allowed = (torch.rand(2, vocab, generator=gen) < 0.3).tolist()
    rows = torch.tensor([3, 0])
    out = apply_token_bitmask(logits, pack(allowed, vocab), rows)
    assert out is logits  # in place: no copy of the step's logits
    for r in (1, 2, 4):
        assert torch.equal(out[r], before[r])
    for i, r in enumerate(rows.tolist()):
        want = torch.where(torch.tensor(allowed[i]), before[r], float("-inf"))
        assert torch.equal(out[r], want)


def test_too_narrow_bitmask_is_an_error():
    with pytest.raises(ValueError, match="covers 32 tokens"):
        unpack_token_bitmask(torch.zeros(1, 1, dtype=torch.int32), 33)


def test_grammar_logits_rows_with_and_without_drafts():
    """Each bitmask row names the logits row it constrains: one row each (the fast path) and, with drafts,
    the k-th row of a request is its k-th logits row."""
    from keel.layers.token_bitmask import grammar_logits_rows

    one_each = grammar_logits_rows(["b", "d"], ["a", "b", "c", "d"], np.array([1, 1, 1, 1]))
    assert one_each.tolist() == [1, 3] and one_each.dtype == np.int64
    with_drafts = grammar_logits_rows(["b", "b", "b", "d"], ["a", "b", "d"], np.array([1, 3, 1]))
    assert with_drafts.tolist() == [1, 2, 3, 4]


def test_a_pinned_bitmask_is_copied_directly_and_a_pageable_one_staged():
    """The runner stages a filled bitmask with the step's inputs only when it is pageable (a worker in
    another process received it); a pinned one -- the manager's, in the engine's process -- is copied to
    the device on its own, without a host copy into the staging buffer."""
    from keel.structured_output.manager import GrammarBitmask
    from keel.worker.grammar_constraint import grammar_arrays

    bits = torch.full((2, 1), -1, dtype=torch.int32)
    for pinned, staged in ((False, True), (True, False)):
        arrays = grammar_arrays(GrammarBitmask(["a", "b"], bits, pinned=pinned), ["a", "b"], np.array([1, 1]))
        assert arrays["grammar_rows"].tolist() == [0, 1] and ("grammar_bitmask" in arrays) == staged
