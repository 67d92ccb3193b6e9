"""The `apply_token_bitmask` custom op: structured outputs' packed grammar bitmask applied to the logits
in one Triton kernel, in place.

Each program reads the int32 words of one bitmask row for a tile of the vocabulary and writes -inf to
the disallowed tokens of the logits row that bitmask row constrains; allowed tokens are never touched.
So the kernel only reads the packed mask (vocab / 8 bytes a row) and writes the masked entries: no
unpacked [R, vocab] bool tensor and no copy of the logits, unlike the torch reference
(`keel.layers.token_bitmask.apply_token_bitmask`), which the CPU keeps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from keel_kernels_triton.support import TritonOp

BLOCK = 2048  # tokens per program: 64 words of the mask


@triton.jit
def apply_token_bitmask_kernel(
    logits_ptr,  # [S, vocab] float (row stride stride_l), written in place
    bitmask_ptr,  # [R, words] int32 (row stride stride_b)
    rows_ptr,  # [R] int64: the logits row of each bitmask row
    vocab, words, stride_l, stride_b,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + r).to(tl.int64)
    word = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    packed = tl.load(bitmask_ptr + r * stride_b + word, mask=word < words, other=-1)  # [BLOCK / 32]
    # Bit b of word w is token 32 w + b; an arithmetic shift keeps bit 31 exact under `& 1`.
    bits = (packed[:, None] >> tl.arange(0, 32)[None, :]) & 1  # [BLOCK / 32, 32]
    banned = tl.reshape(bits == 0, (BLOCK,))
    token = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(logits_ptr + row * stride_l + token, -float("inf"), mask=banned & (token < vocab))


class TritonApplyTokenBitmask(TritonOp):
    """`apply_token_bitmask(logits, bitmask, rows) -> logits` (see keel.layers.custom_op): in place."""

    def __call__(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        num_rows, words = bitmask.shape
        vocab = logits.shape[-1]
        if bitmask.dtype != torch.int32 or words * 32 < vocab or rows.shape != (num_rows,):
            raise ValueError(f"apply_token_bitmask: bitmask {tuple(bitmask.shape)} {bitmask.dtype} and rows "
                             f"{tuple(rows.shape)} do not describe int32 rows covering {vocab} tokens")
        if logits.stride(-1) != 1 or bitmask.stride(-1) != 1:
            raise ValueError("apply_token_bitmask: logits and bitmask need a contiguous last dimension")
        if num_rows:
            apply_token_bitmask_kernel[(num_rows, triton.cdiv(vocab, BLOCK))](
                logits, bitmask, rows, vocab, words, logits.stride(0), bitmask.stride(0), BLOCK=BLOCK,
                num_warps=4,
            )
        return logits
