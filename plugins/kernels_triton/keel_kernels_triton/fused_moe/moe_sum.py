"""The top_k combine of the fused MoE in one kernel: out[t] = sum_j down[t, j] (+ residual[t]).

Called by `fused_experts_triton` (grouped_gemm.py) after the w2 GEMM; the DeepSeek MoE block's shared
experts' output rides in as the residual, saving a launch. On the small-M path `down` is the w2 GEMM's
float32 partials, one per K slice, summed here.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from keel_kernels_triton.pdl import pdl_kwargs
from keel_kernels_triton.support import interpreter_enabled


def _moe_sum_kernel(
    down_ptr,  # [SPLITS, num_tokens, TOP_K, H] (SPLITS == 1: [num_tokens, TOP_K, H])
    out_ptr,  # [num_tokens, H], written
    residual_ptr,  # [num_tokens, H] (read when HAS_RESIDUAL)
    H,
    stride_ds,
    stride_dt,
    stride_dk,
    stride_ot,
    stride_rt,
    TOP_K: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch (keel_kernels_triton.pdl): wait before touching memory
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # out[t] = sum_j down[t, j] (+ residual[t]); each slot's partials are summed in a fixed order and rounded
    # to the output dtype (where the one-slice GEMM rounds its store), the slots are accumulated in float32
    # and rounded once, then the residual is added and rounded again: torch's `.sum(1)` followed by `+`.
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.full((BLOCK_H,), 0.0, dtype=tl.float32)
    for j in range(TOP_K):
        slot = tl.full((BLOCK_H,), 0.0, dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            slot += tl.load(down_ptr + s * stride_ds + t * stride_dt + j * stride_dk + offs, mask=mask,
                            other=0.0).to(tl.float32)
        acc += slot.to(out_ptr.dtype.element_ty).to(tl.float32)
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + t * stride_rt + offs, mask=mask, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + res).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_ot + offs, out, mask=mask)


@functools.cache
def _jitted_sum(interpret: bool) -> Any:
    del interpret
    return triton.jit(_moe_sum_kernel, do_not_specialize=["stride_ds"])  # grows with the token count


def moe_sum(
    down: torch.Tensor,  # [num_tokens, top_k, hidden], or [splits, num_tokens, top_k, hidden] float32 partials
    out: torch.Tensor | None = None,  # [num_tokens, hidden], written; allocated (dtype of down) when None
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor:  # [num_tokens, hidden]: down.sum(1) (+ residual) (partials summed first), dtype of out
    """The top_k combine of `fused_experts_triton` in one launch, optionally adding `residual` (the
    DeepSeek MoE block passes its shared experts' output). Rounds like `down.sum(1) + residual`."""
    if down.dim() not in (3, 4) or down.stride(-1) != 1:
        raise ValueError(f"moe_sum needs down [tokens, top_k, hidden] (or [splits, tokens, top_k, hidden]) with "
                         f"unit last stride, got {tuple(down.shape)}")
    parts = down if down.dim() == 4 else down.unsqueeze(0)
    splits, num_tokens, top_k, hidden = parts.shape
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=down.dtype, device=down.device)
    for name, t in (("out", out), ("residual", residual)):
        if t is not None and (t.shape != (num_tokens, hidden) or t.stride(1) != 1):
            raise ValueError(f"moe_sum {name} must be [{num_tokens}, {hidden}] with unit last stride, "
                             f"got {tuple(t.shape)}")
    if num_tokens == 0:
        return out
    interpret = interpreter_enabled()
    block_h = min(512 if not interpret else 64, triton.next_power_of_2(hidden))
    res = residual if residual is not None else out
    _jitted_sum(interpret)[(num_tokens, -(-hidden // block_h))](
        parts, out, res, hidden, parts.stride(0), parts.stride(1), parts.stride(2), out.stride(0), res.stride(0),
        TOP_K=top_k, SPLITS=splits, HAS_RESIDUAL=residual is not None, BLOCK_H=block_h, **pdl_kwargs(out),
    )
    return out
