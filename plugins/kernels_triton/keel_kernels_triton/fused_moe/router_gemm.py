"""The MoE router's logits in one Triton kernel: 16-bit activations times a float32 gate, float32 sums.

`router_gemm_triton` is what kernels-triton's `router_gemm` custom op (ops.py) runs for a bound router
gate (DeepSeek's `MoEGate`). The reference is `F.linear(x.float(), weight)` (HF computes DeepSeek's router
in float32): the kernel widens each activation tile in registers instead of writing `x.float()` to memory
(a copy kernel and a float32 tensor of the whole step's activations per layer), and accumulates in float32
with IEEE products (never TF32), so only the summation order differs from the reference.

Two launch shapes, chosen from the token count alone (a CUDA graph bucket replays the one it captured):
- decode sizes (<= SMALL_T tokens): products summed by a reduction, no tensor-core tile minimum, so the
  grid splits the experts finely (batch 1, 64 experts: 16 programs each streaming 4 gate rows);
- larger steps: tiles of tokens x experts through `tl.dot` (IEEE float32), K in slices.
The gate weight is read once per token tile; nothing is read back to the host.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from keel_kernels_triton.pdl import pdl_kwargs
from keel_kernels_triton.support import interpreter_enabled

SMALL_T = 8  # up to this many tokens the reduction path runs
_SMALL_TILE = 8192  # elements of one [BLOCK_T, BLOCK_E, BLOCK_K] product tile on the reduction path


def _router_gemm_kernel(
    x_ptr,  # [num_tokens, K] float (16- or 32-bit), unit stride over K
    w_ptr,  # [E, K] float32, contiguous
    out_ptr,  # [num_tokens, E] float32, contiguous; written
    num_tokens,
    stride_x,
    E: tl.constexpr,
    K: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch (keel_kernels_triton.pdl): wait before touching memory
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # out[t, e] = sum_k float32(x[t, k]) * w[e, k]. Reductions through tl.reduce with the standard combine
    # (not tl.sum): see routing.py -- the jitted helpers are bound to the mode triton was first imported in.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    t_mask = offs_t < num_tokens
    e_mask = offs_e < E
    rows = tl.where(t_mask, offs_t, 0).to(tl.int64)
    acc = tl.full((BLOCK_T, BLOCK_E), 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=t_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_K]
        w = tl.load(w_ptr + offs_e[:, None] * K + offs_k[None, :], mask=e_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BLOCK_E, BLOCK_K] float32
        if USE_DOT:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.reduce(x[:, None, :] * w[None, :, :], 2, tl.standard._sum_combine)
    out = out_ptr + rows[:, None] * E + offs_e[None, :]
    tl.store(out, acc, mask=t_mask[:, None] & e_mask[None, :])


@functools.cache
def _jitted(interpret: bool) -> Any:
    del interpret  # part of the cache key only: triton.jit reads TRITON_INTERPRET itself
    return triton.jit(_router_gemm_kernel, do_not_specialize=["num_tokens"])


def router_gemm_launch(num_tokens: int, num_experts: int, k: int) -> dict[str, int | bool]:
    """The constexprs and warps of one launch for this shape (a function of the token count only)."""
    if num_tokens <= SMALL_T:
        block_t = triton.next_power_of_2(num_tokens)
        block_k = min(triton.next_power_of_2(k), 2048, _SMALL_TILE // block_t)
        block_e = max(1, min(triton.next_power_of_2(num_experts), _SMALL_TILE // (block_t * block_k)))
        return {"USE_DOT": False, "BLOCK_T": block_t, "BLOCK_E": block_e, "BLOCK_K": block_k, "num_warps": 4}
    big = num_tokens > 512
    block_e = min(max(16, triton.next_power_of_2(num_experts)), 64 if big else 16)
    return {"USE_DOT": True, "BLOCK_T": 64 if big else 16, "BLOCK_E": block_e, "BLOCK_K": 32,
            "num_warps": 4}


def router_gemm_triton(
    x: torch.Tensor,  # [num_tokens, K] float
    weight: torch.Tensor,  # [E, K] float32
    out: torch.Tensor | None = None,  # [num_tokens, E] float32, written instead of allocating
) -> torch.Tensor:  # [num_tokens, E] float32 = x.float() @ weight.T
    """The router logits in one launch; the caller checks Triton can run on x's device."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router_gemm needs x [tokens, K] and weight [E, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if weight.dtype != torch.float32:
        raise ValueError(f"router_gemm's weight must be float32 (the router runs in float32), got {weight.dtype}")
    num_tokens, k = x.shape
    num_experts = weight.shape[0]
    if out is None:
        out = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    elif out.shape != (num_tokens, num_experts) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"router_gemm out must be contiguous float32 [{num_tokens}, {num_experts}], got "
                         f"{out.dtype} {tuple(out.shape)}")
    if num_tokens == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    launch = router_gemm_launch(num_tokens, num_experts, k)
    num_warps = launch.pop("num_warps")
    grid = (triton.cdiv(num_tokens, launch["BLOCK_T"]), triton.cdiv(num_experts, launch["BLOCK_E"]))
    _jitted(interpreter_enabled())[grid](x, weight, out, num_tokens, x.stride(0), E=num_experts, K=k,
                                         num_warps=num_warps, **launch, **pdl_kwargs(out))
    return out
