"""4-bit packing of GPTQ and AutoAWQ checkpoints, in plain torch (reference path, repacking, quantizer).

GPTQ ("gptq" checkpoint format, AutoGPTQ / GPTQModel v1): `qweight` int32 [in / 8, out], input k of
output n in bits 4 * (k % 8) of word [k // 8, n]; `qzeros` int32 [groups, out / 8], packed along the
output the same way, storing zero - 1 (the format's historical offset; served as stored + 1, as vLLM and
the reference kernels do); `scales` [groups, out]; `g_idx` int32 [in], each input's group (any order
with desc_act). AutoAWQ GEMM: `qweight` int32 [in, out / 8] and `qzeros` [groups, out / 8] packed along
the output in the interleaved order AWQ_ORDER; zeros stored as they are; group of input k is k // g.
"""

from __future__ import annotations

import torch

PACK = 8  # 4-bit values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output 8 * word + AWQ_ORDER[i]
_AWQ_REVERSE = tuple(AWQ_ORDER.index(j) for j in range(PACK))  # output j of a word sits in nibble _AWQ_REVERSE[j]


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, 4, dtype=torch.int32, device=device)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [r / 8, c] packed along rows -> int32 [r, c] in 0..15 (GPTQ qweight)."""
    r8, c = packed.shape
    vals = (packed[:, None, :] >> _shifts(packed.device)[None, :, None]) & 0xF  # [r/8, 8, c]
    return vals.reshape(r8 * PACK, c)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """int [r, c] in 0..15 -> int32 [r / 8, c] (inverse of unpack_rows)."""
    r, c = values.shape
    v = values.to(torch.int32).reshape(r // PACK, PACK, c)
    return _sum_words(v, 1)


def _sum_words(v: torch.Tensor, dim: int) -> torch.Tensor:
    """OR-combine 8 nibbles along `dim` into int32 words (int64 math, then two's complement wrap)."""
    shape = [1] * v.dim()
    shape[dim] = PACK
    words = (v.to(torch.int64) << _shifts(v.device).to(torch.int64).view(shape)).sum(dim=dim)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [r, c / 8] packed along columns -> int32 [r, c]; `order`: AWQ_ORDER for AutoAWQ tensors."""
    r, c8 = packed.shape
    vals = (packed[:, :, None] >> _shifts(packed.device)[None, None, :]) & 0xF  # [r, c/8, nibble]
    if order is not None:
        vals = vals[:, :, list(_AWQ_REVERSE)]  # -> [r, c/8, output within the word]
    return vals.reshape(r, c8 * PACK)


def pack_cols(values: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int [r, c] in 0..15 -> int32 [r, c / 8] (inverse of unpack_cols)."""
    r, c = values.shape
    v = values.to(torch.int32).reshape(r, c // PACK, PACK)  # [r, word, output within the word]
    if order is not None:
        v = v[:, :, list(order)]  # -> [r, word, nibble]
    return _sum_words(v, 2)


def dequantize_int4(
    q: torch.Tensor,  # int32 [in, out] in 0..15
    zeros: torch.Tensor,  # [groups, out] (float or int): the value that decodes to 0
    scales: torch.Tensor,  # [groups, out]
    g_idx: torch.Tensor,  # int [in]: each input's group
    dtype: torch.dtype,
) -> torch.Tensor:  # [in, out]
    g = g_idx.long()
    return ((q.float() - zeros.float()[g]) * scales.float()[g]).to(dtype)
