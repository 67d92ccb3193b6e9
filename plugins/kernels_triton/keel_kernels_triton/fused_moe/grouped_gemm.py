"""Fused MoE in Triton: tokens sorted by expert, one grouped GEMM per projection, weighted combine.

`fused_experts_triton` is what kernels-triton's `fused_experts` custom op (ops.py) runs for a bound
`FusedMoE` layer: on CUDA devices, or on the CPU under `TRITON_INTERPRET=1` (tests).

1. `moe_align_block_size` (align.py) sorts the (token, slot) pairs by expert and pads each expert's run to
   a multiple of BLOCK_M, so every block of BLOCK_M sorted rows belongs to exactly one expert. Experts
   that received no tokens get no block at all. Sizes are upper bounds known without a host sync;
   blocks past the real end exit immediately. A one-token step skips it (`PAIR_BLOCKS_MAX_TOKENS`): block i
   holds pair i alone, its expert read from the routed ids.
2. `_fused_moe_kernel` on w13: rows gathered from `hidden` by sorted id // top_k, times the block's
   expert weight -> gate_up [num_tokens * top_k, 2 * intermediate] in (token, slot) order. With the w13
   tile config's `act_epilogue` (silu only) each program computes a gate tile and the matching up tile and
   stores silu(gate) * up [num_tokens * top_k, intermediate] instead: half the stores, and the down GEMM
   reads a plain activation.
3. `_fused_moe_kernel` on w2, multiplying each row by its routing weight -> [num_tokens * top_k, hidden].
   Without the epilogue, for silu the gated activation happens in this GEMM's A load (silu(gate) * up,
   rounded as the torch path rounds; recomputed by every N-block), unless the w2 tile config says
   `fused_act` False (prefill sizes: kernels-triton's silu_and_mul runs first); other activations run in
   torch in between.
4. `moe_sum` (moe_sum.py) adds the top_k slots of each token (and optionally a residual such as the
   shared experts' output) in one small kernel.

Tile sizes come from `tile_config.get_moe_tile_configs` (tuned JSON files per device and shape, else a
heuristic); both GEMMs of a call use one block_m, the padding unit of step 1.

The kernels are jitted on first use and cached per interpreter mode, because Triton decides at
decoration time whether a function is compiled or interpreted.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from keel.layers.activation import get_act_and_mul_fn
from keel_kernels_triton.fused_moe.align import moe_align_block_size
from keel_kernels_triton.fused_moe.moe_sum import moe_sum
from keel_kernels_triton.fused_moe.tile_config import MoETileConfig, get_moe_tile_configs
from keel_kernels_triton.pdl import pdl_kwargs
from keel_kernels_triton.support import interpreter_enabled

# Steps of at most this many tokens skip the alignment: each (token, route) pair is its own M-block, its expert
# read from the routed ids (a batch-1 decode step's routes are distinct experts, so nothing is read twice;
# two tokens would read a shared expert twice). A function of the token count: a CUDA graph replays its path.
PAIR_BLOCKS_MAX_TOKENS = 1

# Activations the w2 GEMM computes in its A load; the rest run in torch between the GEMMs.
FUSED_ACTIVATIONS = ("silu", "swish")


def _fused_moe_kernel(
    a_ptr,
    b_ptr,
    b_desc,  # WEIGHT_TMA: a TMA descriptor over b as [E * N, K] with [BLOCK_N, BLOCK_K] boxes; else None
    c_ptr,
    topk_weights_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,
    K: tl.constexpr,  # the reduction size (hidden or intermediate): two values per model, so constexpr;
    # a runtime K trips older interpreters' range() over a scalar tensor
    num_valid_tokens,
    num_m_blocks,  # GROUP_M > 1: M-blocks of the 1-D grid (program_id(0) = M-block x N-block)
    stride_am,
    stride_ak,
    stride_as,  # between A's float32 partials (A_SPLITS > 1)
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_cs,  # between C's float32 partials (SPLIT_K > 1)
    A_ROW_DIV: tl.constexpr,
    A_SPLITS: tl.constexpr,  # A is the sum of this many float32 partials [A_SPLITS, rows, ...] (small-M path)
    ACT_SILU: tl.constexpr,  # A is gate_up [rows, 2 * K]; the GEMM reads silu(A[:, :K]) * A[:, K:]
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    SPLIT_K: tl.constexpr,  # > 1: program_id(2) takes one K slice and writes a float32 partial of C
    K_SLICE: tl.constexpr,  # K per slice, a multiple of BLOCK_K (K itself when SPLIT_K == 1)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,  # 1: grid (M-blocks, N-blocks); > 1: 1-D grid, groups of GROUP_M M-blocks
    EVEN_K: tl.constexpr,  # K is whole BLOCK_K tiles and not split: the main loop loads without a K mask
    USE_DOT: tl.constexpr,  # False: the GEMV form, products summed over K on CUDA cores (BLOCK_M may be < 16)
    WEIGHT_TMA: tl.constexpr,  # weight tiles through b_desc (zero past K) instead of pointer loads
    GATED: tl.constexpr = False,  # w13 with the silu epilogue: b holds 2 * N rows per expert (gate, then up);
    # C [rows, N] = silu(A @ gate.T) * (A @ up.T), each rounded as torch's F.silu(gate) * up rounds
    PAIR_BLOCKS: tl.constexpr = False,  # one (token, route) pair per M-block, expert from the routed ids
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch (keel_kernels_triton.pdl): wait before touching memory
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # C[sorted rows, N-block] = A[rows // A_ROW_DIV] @ B[expert of this M-block].T (* routing weight), or with
    # SPLIT_K > 1 the same over the K slice of program_id(2), into that slice's float32 partial.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    if GROUP_M > 1:  # M-block fastest within a group of GROUP_M, then N-block, then the next group
        num_n_blocks = (N + BLOCK_N - 1) // BLOCK_N
        pid = tl.program_id(0)
        per_group = GROUP_M * num_n_blocks
        first_m = (pid // per_group) * GROUP_M
        group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_size
        pid_n = (pid % per_group) // group_size
    if PAIR_BLOCKS:  # M-block i holds pair i alone; expert_ids_ptr is the flat routed ids (no alignment)
        offs_token = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_valid_tokens)
    else:
        num_tokens_post_padded = tl.load(num_tokens_post_padded_ptr)
        if pid_m * BLOCK_M >= num_tokens_post_padded:
            return
        offs_token_id = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_token = tl.load(sorted_token_ids_ptr + offs_token_id)
    token_mask = offs_token < num_valid_tokens
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_s * K_SLICE
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = tl.where(token_mask, offs_token // A_ROW_DIV, 0).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + (k_start + offs_k)[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + (k_start + offs_k)[:, None] * stride_bk + offs_n[None, :] * stride_bn
    b_rows = 2 * N if GATED else N  # weight rows per expert (TMA row coordinates)
    # Only core builtins (tl.full, not tl.zeros / tl.cdiv): the jitted helpers of triton.language.standard
    # are bound to the mode (compiled or interpreted) triton was first imported in, which may not be ours.
    if USE_DOT:
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
        if GATED:
            acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    else:  # per (row, k, n) partial sums, reduced over k once after the loop: no shuffles in the loop
        acc3 = tl.full((BLOCK_M, BLOCK_K, BLOCK_N), 0.0, dtype=tl.float32)
        if GATED:
            acc3_up = tl.full((BLOCK_M, BLOCK_K, BLOCK_N), 0.0, dtype=tl.float32)
    for k in range((K_SLICE + BLOCK_K - 1) // BLOCK_K):
        k_left = K - k_start - k * BLOCK_K  # <= 0 past K: the tile is all masked
        if EVEN_K:
            a_mask = token_mask[:, None]
        else:
            a_mask = token_mask[:, None] & (offs_k[None, :] < k_left)
        if A_SPLITS > 1:
            # float32 partials of the previous GEMM, summed in a fixed order and rounded once to the
            # activation dtype, as the one-slice path stores them
            gate = tl.full((BLOCK_M, BLOCK_K), 0.0, dtype=tl.float32)
            up = tl.full((BLOCK_M, BLOCK_K), 0.0, dtype=tl.float32)
            for s in tl.static_range(A_SPLITS):
                gate += tl.load(a_ptrs + s * stride_as, mask=a_mask, other=0.0)
                if ACT_SILU:
                    up += tl.load(a_ptrs + s * stride_as + K * stride_ak, mask=a_mask, other=0.0)
            gate = gate.to(b_ptr.dtype.element_ty).to(tl.float32)
            up = up.to(b_ptr.dtype.element_ty).to(tl.float32)
        else:
            gate = tl.load(a_ptrs, mask=a_mask, other=0.0).to(tl.float32)
            if ACT_SILU:
                up = tl.load(a_ptrs + K * stride_ak, mask=a_mask, other=0.0).to(tl.float32)
        if ACT_SILU:
            # Rounded twice to B's (the activation) dtype, as torch's F.silu(gate) * up rounds each result.
            act = (gate / (1.0 + tl.exp(-gate))).to(b_ptr.dtype.element_ty).to(tl.float32)
            a = (act * up).to(b_ptr.dtype.element_ty)
        else:
            a = gate.to(b_ptr.dtype.element_ty)
        if WEIGHT_TMA:
            # rows past this half (the up half, the next expert) fill a ragged last N-block; never stored
            row0 = (expert * b_rows).to(tl.int32) + pid_n * BLOCK_N
            b = tl.trans(b_desc.load([row0, k_start + k * BLOCK_K]))
            if GATED:
                b_up = tl.trans(b_desc.load([row0 + N, k_start + k * BLOCK_K]))
        elif EVEN_K:
            b = tl.load(b_ptrs, mask=offs_n[None, :] < N, other=0.0)
            if GATED:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=offs_n[None, :] < N, other=0.0)
        else:
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
            if GATED:
                b_up = tl.load(b_ptrs + N * stride_bn,
                               mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if not USE_DOT:  # exact float32 products of 16-bit operands, float32 sums (as the dot accumulates)
            acc3 += a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
            if GATED:
                acc3_up += a.to(tl.float32)[:, :, None] * b_up.to(tl.float32)[None, :, :]
        else:
            if UPCAST_DOT:  # the interpreter's dot misreads 16-bit floats; compiled kernels keep them
                a = a.to(tl.float32)
                b = b.to(tl.float32)
                if GATED:
                    b_up = b_up.to(tl.float32)
            acc += tl.dot(a, b, input_precision=DOT_PRECISION)
            if GATED:
                acc_up += tl.dot(a, b_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if not USE_DOT:
        # tl.reduce with standard's combine, not tl.sum (a jitted helper bound to the mode triton was first
        # imported in; see routing.py)
        acc = tl.reduce(acc3, 1, tl.standard._sum_combine)  # [BLOCK_M, BLOCK_N]
        if GATED:
            acc_up = tl.reduce(acc3_up, 1, tl.standard._sum_combine)
    if GATED:
        # gate and up rounded to C's dtype as the unfused path stores them, silu rounded, the product rounded
        gate = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(c_ptr.dtype.element_ty).to(tl.float32)
        acc = act * acc_up.to(c_ptr.dtype.element_ty).to(tl.float32)
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + tl.where(token_mask, offs_token, 0), mask=token_mask, other=0.0)
        acc = acc * w[:, None]
    c_rows = tl.where(token_mask, offs_token, 0).to(tl.int64)
    c_ptrs = c_ptr + pid_s * stride_cs + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=token_mask[:, None] & (offs_n[None, :] < N))


@functools.cache
def _jitted(interpret: bool) -> Any:
    del interpret  # part of the cache key only: triton.jit reads TRITON_INTERPRET itself
    # num_valid_tokens (tokens x top-k) only bounds a mask, and the partials' strides grow with it: not
    # specializing on their divisibility by 16 keeps one compiled variant per tile config, so the startup
    # warm-up's power-of-two token counts cover every count a step can have (an H200 run compiled two
    # more variants in its first batch).
    return triton.jit(_fused_moe_kernel, do_not_specialize=["num_valid_tokens", "num_m_blocks", "stride_as",
                                                            "stride_cs"])


def live_block_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most blocks of block_m sorted rows that hold any pair: sum_e ceil(c_e / block_m) over the
    n <= min(E, pairs) experts with c_e > 0 pairs is at most (pairs - n) // block_m + n, which grows
    with n. At decode sizes this is far below the padded buffer's block count (1 token, top-6 of 64
    experts: 6 of 61), and the programs past it would only exit."""
    n = min(num_experts, num_pairs)
    return (num_pairs - n) // block_m + n


def invoke_fused_moe_kernel(
    a: torch.Tensor,  # [rows_a, K] or gate_up [rows_a, 2 * K] (act_silu); or [a_splits, ...] of those, float32
    b: torch.Tensor,  # [E, N, K]
    c: torch.Tensor,  # [num_tokens * top_k, N], written; [split_k, num_tokens * top_k, N] float32 when split
    topk_weights: torch.Tensor | None,  # [num_tokens * top_k] float32
    sorted_ids: torch.Tensor,  # [max_padded] int32, padded to config.block_m
    expert_ids: torch.Tensor,  # [max_padded // config.block_m] int32
    total: torch.Tensor,  # [1] int32
    a_row_div: int,
    config: MoETileConfig,
    act_silu: bool = False,
    even_k: bool | None = None,  # None: whenever K is whole BLOCK_K tiles and not split (benchmarks pass False)
    gated: bool = False,  # w13 with the silu epilogue: c is [rows, N / 2] = silu(gate) * up
    pair_blocks: bool = False,  # expert_ids is the flat routed ids [rows], one pair per M-block; sorted_ids and
    # total are not read
) -> None:
    """One grouped GEMM launch. `config.split_k` > 1 takes the small-M path: program_id(2) splits K and each
    slice writes its float32 partial of `c` ([split_k, rows, N]); a 3-D float32 `a` holds the previous
    GEMM's partials, summed in the A load. `gated`: b's rows per expert are gate then up, and `c` gets
    silu(gate) * up (one K slice only)."""
    interpret = interpreter_enabled()
    kernel = _jitted(interpret)
    n, k = b.shape[1], b.shape[2]
    split = config.split_k or 1
    if gated:
        if split > 1 or act_silu or topk_weights is not None or n % 2 or c.dim() != 2 or c.shape[1] != n // 2:
            raise ValueError(f"the silu epilogue takes one K slice, no routing weights, c [rows, {n // 2}]; "
                             f"got split_k={split}, c {tuple(c.shape)}")
        n //= 2
    if not pair_blocks and expert_ids.numel() * config.block_m != sorted_ids.numel():
        raise ValueError(f"sorted ids were padded for another block_m than the tile config's {config.block_m}")
    a_splits = a.shape[0] if a.dim() == 3 else 1
    if (a.dim() == 3 and a.dtype != torch.float32) or (split > 1 and (c.dim() != 3 or c.shape[0] != split
                                                                      or c.dtype != torch.float32)):
        raise ValueError(f"split GEMMs read and write float32 partials [splits, rows, N]; got a {tuple(a.shape)} "
                         f"{a.dtype}, c {tuple(c.shape)} {c.dtype} for split_k={split}")
    a2 = a[0] if a.dim() == 3 else a
    c2 = c[0] if c.dim() == 3 else c
    rows = c2.shape[0]
    if pair_blocks and expert_ids.numel() != rows:
        raise ValueError(f"pair blocks take the {rows} routed ids, got {expert_ids.numel()}")
    grid_m = rows if pair_blocks else min(expert_ids.numel(), live_block_bound(rows, b.shape[0], config.block_m))
    per_split = -(-k // split)
    k_slice = -(-per_split // config.block_k) * config.block_k  # whole BLOCK_K tiles per slice
    grid_n = -(-n // config.block_n)
    grid = (grid_m, grid_n, split) if config.group_m == 1 else (grid_m * grid_n, 1, split)
    b_desc = _weight_descriptor(b, config) if config.weight_tma else None
    kernel[grid](
        a, b, b_desc, c, topk_weights if topk_weights is not None else c2, sorted_ids, expert_ids, total,
        n, k, rows, grid_m,
        a2.stride(0), a2.stride(1), a.stride(0) if a.dim() == 3 else 0,
        b.stride(0), b.stride(1), b.stride(2),
        c2.stride(0), c2.stride(1), c.stride(0) if c.dim() == 3 else 0,
        A_ROW_DIV=a_row_div,
        A_SPLITS=a_splits,
        ACT_SILU=act_silu,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        # float32 must not silently drop to TF32 on GPUs: fidelity tests compare at 1e-4.
        DOT_PRECISION="ieee" if b.dtype == torch.float32 else "tf32",
        UPCAST_DOT=interpret and b.dtype != torch.float32,
        SPLIT_K=split,
        K_SLICE=k_slice if split > 1 else k,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        EVEN_K=(split == 1 and k % config.block_k == 0) if even_k is None else even_k,
        USE_DOT=config.kernel == "dot",
        WEIGHT_TMA=config.weight_tma,
        GATED=gated,
        PAIR_BLOCKS=pair_blocks,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_kwargs(c),
    )


def _weight_descriptor(b: torch.Tensor, config: MoETileConfig) -> Any:  # b: [E, N, K], K contiguous
    from triton.tools.tensor_descriptor import TensorDescriptor  # Triton >= 3.4

    e, n, k = b.shape
    if b.stride(2) != 1 or b.stride(0) != n * b.stride(1):
        raise ValueError(f"weight TMA needs [E, N, K] weights with rows packed, got strides {b.stride()}")
    return TensorDescriptor(b, [e * n, k], [b.stride(1), 1], [config.block_n, config.block_k])


def fused_experts_triton(
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden_size]
    w2: torch.Tensor,  # [num_experts, hidden_size, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    activation: str = "silu",
    residual: torch.Tensor | None = None,  # [num_tokens, hidden_size], added to the result
    *,
    tile_configs: tuple[MoETileConfig, MoETileConfig] | None = None,  # (w13, w2); default: get_moe_tile_configs
) -> torch.Tensor:  # [num_tokens, hidden_size], dtype of hidden
    """Same contract as `fused_experts_torch` (plus `residual`), computed by the grouped-GEMM kernel."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(hidden) if residual is None else residual.clone()
    hidden = hidden.contiguous()
    if tile_configs is None:
        tile_configs = get_moe_tile_configs(num_tokens, tuple(w13.shape), tuple(w2.shape), top_k, hidden.dtype,
                                            hidden.device, interpreter_enabled())
    c13, c2 = tile_configs
    if c13.block_m != c2.block_m:
        raise ValueError(f"both GEMMs of one MoE call need one block_m, got {c13.block_m} and {c2.block_m}")
    rows = num_tokens * top_k
    pairs = num_tokens <= PAIR_BLOCKS_MAX_TOKENS
    if pairs:  # each pair its own M-block, straight from the routed ids: no alignment launch in the chain
        flat_ids = topk_ids.reshape(-1)
        sorted_ids, expert_ids, total = flat_ids, flat_ids, flat_ids
    else:
        sorted_ids, expert_ids, total = moe_align_block_size(topk_ids, w13.shape[0], c13.block_m)
    silu = activation.lower() in FUSED_ACTIVATIONS
    if c13.act_epilogue and silu:  # [rows, I] = silu(gate) * up straight from the w13 GEMM (one K slice:
        # the config refuses another split, and a lookup resolves an unset one to 1)
        gate_up = torch.empty(rows, w13.shape[1] // 2, dtype=hidden.dtype, device=hidden.device)
        invoke_fused_moe_kernel(hidden, w13, gate_up, None, sorted_ids, expert_ids, total, top_k, c13,
                                gated=True, pair_blocks=pairs)
        fuse = False
    else:
        gate_up = _gemm_output(c13, rows, w13.shape[1], hidden)  # [rows, 2I] or [split, rows, 2I] float32
        invoke_fused_moe_kernel(hidden, w13, gate_up, None, sorted_ids, expert_ids, total, top_k, c13,
                                pair_blocks=pairs)
        fuse = silu and c2.fused_act
        if not fuse:
            if gate_up.dim() == 3:  # the torch activation needs gate_up itself: sum the partials, round once
                gate_up = gate_up.sum(0).to(hidden.dtype)
            gate_up = act_and_mul(gate_up, activation)  # [rows, intermediate]
    down = _gemm_output(c2, rows, w2.shape[1], hidden)  # [rows, H] or [split, rows, H] float32
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    invoke_fused_moe_kernel(gate_up, w2, down, weights, sorted_ids, expert_ids, total, 1, c2, act_silu=fuse,
                            pair_blocks=pairs)
    return moe_sum(down.view(*down.shape[:-2], num_tokens, top_k, -1), torch.empty_like(hidden), residual=residual)


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:  # [rows, 2I] -> [rows, I]
    """The gated activation between the two GEMMs when it runs as its own step (a contiguous result):
    kernels-triton's silu_and_mul kernel for silu on a GPU (one launch, one pass; rounds as torch does),
    else the torch module."""
    if activation.lower() in FUSED_ACTIVATIONS and not interpreter_enabled():
        return _silu_and_mul()(gate_up)
    return get_act_and_mul_fn(activation)(gate_up).contiguous()


@functools.cache
def _silu_and_mul():
    from keel_kernels_triton.ops import TritonSiluAndMul  # the dense MLP's kernel: same rounding as torch's

    return TritonSiluAndMul()


def _gemm_output(config: MoETileConfig, rows: int, n: int, like: torch.Tensor) -> torch.Tensor:
    if (config.split_k or 1) > 1:  # small-M path: one float32 partial per K slice, summed by the consumer
        return torch.empty(config.split_k, rows, n, dtype=torch.float32, device=like.device)
    return torch.empty(rows, n, dtype=like.dtype, device=like.device)
