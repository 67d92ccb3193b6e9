"""Applying a packed token bitmask to logits on the device: structured outputs' per-step constraint.

The bitmask arrives int32 `[R, ceil(vocab / 32)]` (bit `t % 32` of word `t // 32` = token t allowed,
`keel.structured_output.backend`) for R of the step's S sampling rows. `TokenBitmask` is the layer the
model runner applies it with: a bound `apply_token_bitmask` custom op (kernels-triton: one fused kernel
over the packed words) or, unbound (the CPU), the torch reference below, whose unpacking and masking
are plain tensor ops of static shape per (R, vocab). Both mask the logits in place and sync nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def unpack_token_bitmask(
    bitmask: torch.Tensor,  # [R, W] int32
    vocab_size: int,
) -> torch.Tensor:  # [R, vocab_size] bool, True = allowed
    rows, words = bitmask.shape
    if vocab_size > words * 32:
        raise ValueError(f"a token bitmask of {words} words covers {words * 32} tokens, not {vocab_size}")
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    # Arithmetic shift of a negative word still leaves bit 31 in the lowest bit: `& 1` is exact.
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    return bits.view(rows, words * 32)[:, :vocab_size].bool()


def apply_token_bitmask(
    logits: torch.Tensor,  # [S, vocab] float, masked in place
    bitmask: torch.Tensor,  # [R, W] int32, on the logits' device
    rows: torch.Tensor,  # [R] int64: the logits row each bitmask row constrains (distinct)
) -> torch.Tensor:  # `logits`, disallowed tokens of those rows at -inf; other rows untouched
    allowed = unpack_token_bitmask(bitmask, logits.shape[-1])  # [R, vocab]
    masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))  # [R, vocab]
    return logits.index_copy_(0, rows, masked)


class TokenBitmask(torch.nn.Module):
    """The model runner's grammar-mask step, a layer so that a kernel plugin can bind its op into it
    (`keel.layers.custom_op`; the worker binds it with the model's layers). Called by the runner right
    before sampling, once per step with constrained rows."""

    custom_ops = ("apply_token_bitmask",)

    def forward(
        self,
        logits: torch.Tensor,  # [S, vocab] float32 (masked in place) or 16-bit (upcast first)
        bitmask: torch.Tensor,  # [R, W] int32, on the logits' device
        rows: torch.Tensor,  # [R] int64
    ) -> torch.Tensor:  # [S, vocab] float32: `logits`, or their upcast copy
        # The mask runs on float32 logits, the dtype the startup profile compiles a bound op's kernel for
        # (`Model.compute_logits` may return the model dtype; the upcast is exact).
        logits = logits.float()
        op = getattr(self, "bound_ops", {}).get("apply_token_bitmask")
        return apply_token_bitmask(logits, bitmask, rows) if op is None else op(logits, bitmask, rows)


def grammar_logits_rows(
    bitmask_req_ids: Sequence[str],  # [R]: a request with drafts repeats, once per verify position
    sampling_req_ids: Sequence[str],  # [S'] the requests that sample, in logits order
    num_sample_rows: np.ndarray,  # [S'] logits rows of each (1, or 1 + its drafts)
) -> np.ndarray:  # [R] int64: the logits row each bitmask row constrains
    """Called by the model runner when it stages a step's bitmask: the k-th row of a request is its k-th
    logits row."""
    if int(num_sample_rows.sum()) == len(sampling_req_ids):  # one logits row each (no drafts): row = position
        position = dict(zip(sampling_req_ids, range(len(sampling_req_ids))))
        return np.fromiter(map(position.__getitem__, bitmask_req_ids), dtype=np.int64, count=len(bitmask_req_ids))
    first = dict(zip(sampling_req_ids, (np.cumsum(num_sample_rows) - num_sample_rows).tolist()))
    seen: dict[str, int] = {}
    out = np.empty(len(bitmask_req_ids), dtype=np.int64)
    for i, rid in enumerate(bitmask_req_ids):
        k = seen.get(rid, 0)
        out[i] = first[rid] + k
        seen[rid] = k + 1
    return out
