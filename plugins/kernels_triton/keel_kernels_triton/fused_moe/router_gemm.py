"""The MoE router's logits in one Triton kernel: 16-bit activations times a float32 gate, float32 sums.

`router_gemm_triton` is what kernels-triton's `router_gemm` custom op (ops.py) runs for a bound router
gate (DeepSeek's `MoEGate`). The reference is `F.linear(x.float(), weight)` (HF computes DeepSeek's router
in float32): the kernel widens each activation tile in registers instead of writing `x.float()` to memory
(a copy kernel and a float32 tensor of the whole step's activations per layer), and accumulates in float32
with exact products (never TF32), so only the summation order differs from the reference.

Two launch shapes, chosen from the token count alone (a CUDA graph bucket replays the one it captured):
- decode sizes (<= SMALL_T tokens): products summed by a reduction, no tensor-core tile minimum, so the
  grid splits the experts finely (batch 1, 64 experts: 16 programs each streaming 4 gate rows);
- larger steps: tiles of tokens x experts through `tl.dot`, K in slices. With bfloat16 activations
  the float32 gate tile is split in registers into three bfloat16 parts, w = hi + mid + lo exactly for
  |w| >= 2^-110 (each part holds the next 8 significant bits of the remainder), and three bf16
  tensor-core dots accumulate in float32: every product x * part is exact, so the logits differ from
  `F.linear(x.float(), w)` only in summation order, at tensor-core speed. Otherwise (float16 or float32
  activations) IEEE float32 dots, which run on CUDA cores (H200: 46 us per DSV2-Lite layer at 256 tokens,
  against 13 us for the copy + cuBLAS).
  With bf16 activations K is also split across programs until the grid has ~256 of them (slices of 256 or
  more, counted from the token count's power of two, so the warm-up compiles each variant): each program
  writes float32 partials and `moe_sum` adds them in slice order (a fixed order per token count, so
  repeatable), a second launch instead of a chain of K / 64 dependent steps per program.
The gate weight is read once per token tile and K slice; nothing is read back to the host.

Prediction for the split path (before any GPU run): DSV2-Lite's router at 256 tokens ~5 us per layer
(copy + cuBLAS fp32 13 us), at 8192 ~15 us (117 us). Outcome on an H100 SXM at e3a41fb
(`h100-router-gemm-e3a41fb.json`): wrong below ~2048 tokens -- a flat 25 us up to 256 tokens and 42 us at
1024 against 10-25 us, since one program per 16 (64) tokens leaves most SMs idle and each walks all of K --
and at 8192 tokens 38.5 against 112.8 us, 2.9x (predicted 7.8x; V3: 338 against 757). Hence the split K.
Predicted (DSV2-Lite, H100, per layer): ~7 us at 16 and 256 tokens, ~8 at 1024, ~25 at 8192 (38.5 unsplit);
V3 ~25 at 256. Measured at f183f15 (`h100-router-gemm-splitk-f183f15.json`), us at 16 / 64 / 256 / 1024 /
2048 / 4096 / 8192 tokens: DSV2-Lite 5.2 / 5.3 / 6.6 / 8.9 / 13.0 / 22.1 / 40.3 against the reference's
10.2 / 10.7 / 12.3 / 25.4 / 37.3 / 63.0 / 113.2; V3 6.0 / 9.8 / 38.2 / 49.8 / 96 / 178 / 345 against 20.5 /
22.7 / 43.0 / 116 / 205 / 392 / 761. Faster everywhere, so `ops` runs it for every bf16 step; wrong where
the split is 2 (DSV2-Lite at 8192: 40.3, unsplit 38.5) or the slices long (V3 at 256: 4 slices of 1792).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from keel_kernels_triton.fused_moe.moe_sum import moe_sum
from keel_kernels_triton.pdl import pdl_kwargs
from keel_kernels_triton.support import interpreter_enabled

SMALL_T = 8  # up to this many tokens the reduction path runs
_SMALL_TILE = 8192  # elements of one [BLOCK_T, BLOCK_E, BLOCK_K] product tile on the reduction path
_SPLIT_PROGRAMS = 256  # the split-weight path splits K until its grid has about this many programs
_K_SLICE = 256  # ... into slices of at least this many K elements


def _router_gemm_kernel(
    x_ptr,  # [num_tokens, K] float (16- or 32-bit), unit stride over K
    w_ptr,  # [E, K] float32, contiguous
    out_ptr,  # [cdiv(K, K_SLICE), num_tokens, E] float32, contiguous; written (one [num_tokens, E] per slice)
    num_tokens,
    stride_x,
    E: tl.constexpr,
    K: tl.constexpr,
    USE_DOT: tl.constexpr,
    SPLIT_W: tl.constexpr,  # USE_DOT with bf16 x: w as three exact bf16 parts, three bf16 tensor-core dots
    UPCAST_DOT: tl.constexpr,  # the interpreter's dot misreads 16-bit floats: widen the split parts first
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_SLICE: tl.constexpr,  # K elements per program (axis 2 of the grid); K itself when K is not split
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
    k_begin = tl.program_id(2) * K_SLICE  # split K: this program's slice, its sums to out's slice 2 (below)
    for k0 in range(k_begin, k_begin + K_SLICE, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K  # (K_SLICE is a multiple of BLOCK_K: a slice ends where the next begins)
        x16 = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :],
                      mask=t_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_T, BLOCK_K], x's dtype
        x = x16.to(tl.float32)
        w = tl.load(w_ptr + offs_e[:, None] * K + offs_k[None, :], mask=e_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BLOCK_E, BLOCK_K] float32
        if SPLIT_W:
            # w = hi + mid + lo exactly: each remainder is exact in float32 and has at most 8 significant bits
            # left after the part before it (any rounding of the cast keeps this true)
            w_hi = w.to(tl.bfloat16)
            rest = w - w_hi.to(tl.float32)
            w_mid = rest.to(tl.bfloat16)
            w_lo = (rest - w_mid.to(tl.float32)).to(tl.bfloat16)
            if UPCAST_DOT:  # x16 is bf16 (SPLIT_W is only asked for then); x is its exact widening
                acc += tl.dot(x, tl.trans(w_hi.to(tl.float32)), input_precision="ieee")
                acc += tl.dot(x, tl.trans(w_mid.to(tl.float32)), input_precision="ieee")
                acc += tl.dot(x, tl.trans(w_lo.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x16, tl.trans(w_hi))
                acc += tl.dot(x16, tl.trans(w_mid))
                acc += tl.dot(x16, tl.trans(w_lo))
        elif USE_DOT:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.reduce(x[:, None, :] * w[None, :, :], 2, tl.standard._sum_combine)
    out = out_ptr + tl.program_id(2).to(tl.int64) * num_tokens * E + rows[:, None] * E + offs_e[None, :]
    tl.store(out, acc, mask=t_mask[:, None] & e_mask[None, :])


@functools.cache
def _jitted(interpret: bool) -> Any:
    del interpret  # part of the cache key only: triton.jit reads TRITON_INTERPRET itself
    return triton.jit(_router_gemm_kernel, do_not_specialize=["num_tokens"])


def router_gemm_launch(
    num_tokens: int, num_experts: int, k: int, split_w: bool = False
) -> dict[str, int | bool]:
    """The constexprs and warps of one launch for this shape (a function of the token count and whether the
    activations are bf16 (`split_w`: the split-weight tensor-core path) only). `K_SLICE` < k splits K
    across programs: each writes float32 partials, which `moe_sum` adds in slice order."""
    if num_tokens <= SMALL_T:
        block_t = triton.next_power_of_2(num_tokens)
        block_k = min(triton.next_power_of_2(k), 2048, _SMALL_TILE // block_t)
        block_e = max(1, min(triton.next_power_of_2(num_experts), _SMALL_TILE // (block_t * block_k)))
        return {"USE_DOT": False, "SPLIT_W": False, "BLOCK_T": block_t, "BLOCK_E": block_e,
                "BLOCK_K": block_k, "K_SLICE": k, "num_warps": 4}
    big = num_tokens > 512
    if split_w:  # every expert of a token tile in one program (the gate read once per token tile), K split
        # until the grid has _SPLIT_PROGRAMS programs (one program walking all of K is ~0.8 us per 64: too
        # long a chain when there are few token tiles), in slices of at least _K_SLICE
        block_t, block_k = (64 if big else 16), 64
        block_e = min(max(16, triton.next_power_of_2(num_experts)), 64)
        # The slice length is a constexpr, so every split count is a compile: counted from the token count
        # rounded up to a power of two, so the startup warm-up (powers of two of tokens) meets each one (at
        # 22b91ee, counted from the exact count, the ones between compiled in the first big batch: DSV2-Lite's
        # round 1 at 0.91x its round 2 on an H100)
        tiles = triton.cdiv(triton.next_power_of_2(num_tokens), block_t) * triton.cdiv(num_experts, block_e)
        splits = max(1, min(triton.cdiv(_SPLIT_PROGRAMS, tiles), triton.cdiv(k, _K_SLICE)))
        k_slice = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
        return {"USE_DOT": True, "SPLIT_W": True, "BLOCK_T": block_t, "BLOCK_E": block_e,
                "BLOCK_K": block_k, "K_SLICE": k_slice, "num_warps": 4}
    block_e = min(max(16, triton.next_power_of_2(num_experts)), 64 if big else 16)
    return {"USE_DOT": True, "SPLIT_W": False, "BLOCK_T": 64 if big else 16, "BLOCK_E": block_e,
            "BLOCK_K": 32, "K_SLICE": k, "num_warps": 4}


def router_gemm_triton(
    x: torch.Tensor,  # [num_tokens, K] float
    weight: torch.Tensor,  # [E, K] float32
    out: torch.Tensor | None = None,  # [num_tokens, E] float32, written instead of allocating
) -> torch.Tensor:  # [num_tokens, E] float32 = x.float() @ weight.T
    """The router logits in one launch (and a `moe_sum` of the slices when K is split); the caller checks
    Triton can run on x's device."""
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
    launch = router_gemm_launch(num_tokens, num_experts, k, split_w=x.dtype == torch.bfloat16)
    num_warps = launch.pop("num_warps")
    splits = triton.cdiv(k, launch["K_SLICE"])
    # [splits, num_tokens, E] float32 partials when K is split, summed in slice order by moe_sum
    dest = out if splits == 1 else torch.empty(splits, num_tokens, num_experts, dtype=torch.float32,
                                               device=x.device)
    grid = (triton.cdiv(num_tokens, launch["BLOCK_T"]), triton.cdiv(num_experts, launch["BLOCK_E"]), splits)
    interpret = interpreter_enabled()
    _jitted(interpret)[grid](x, weight, dest, num_tokens, x.stride(0), E=num_experts, K=k,
                             UPCAST_DOT=interpret, num_warps=num_warps, **launch, **pdl_kwargs(dest))
    if splits > 1:
        moe_sum(dest.unsqueeze(2), out)  # [splits, num_tokens, 1, E] -> [num_tokens, E]
    return out
