"""Triton FP8 GEMMs with per-group scales: y = sum over K groups of (a @ b_q^T) * [a_s] * b_s.

`fp8_gemm(a_q, a_s, b_q, b_s, group_n, group_k)` (W8A8): a_q e4m3 [M, K] with float32 scales a_s
[M, ceil(K / gk)] (activations quantized per token and gk-input group), b_q e4m3 [N, K] with b_s
[ceil(N / gn), ceil(K / gk)]. One shape serves every FP8 layout: block FP8 (DeepSeek-V3 / vLLM's
w8a8_block_fp8_matmul: gn = gk = 128) and per-channel weights with per-token activations (gn = 1, gk = K:
one group). Each K tile lies in one scale group (BLOCK_K divides gk, or gk = K), so the fp8 MMA runs on
raw tiles and the scales multiply the tile's float32 partial product.

`fp8_weight_only_gemm(x, b_q, b_s, group_n, group_k)` (small M): the same kernel with activations in
the model dtype and no activation scale; each fp8 weight tile is widened to x's dtype in registers, so a
decode step reads the 1-byte weight once and quantizes nothing. Its tiles are narrow in N so that even
M = 1 spreads every layer over all the SMs.

Only loads touch fp8 (Triton's CPU interpreter rounds fp8 casts wrongly, loads exactly), so the
interpreted kernel is checked against the reference on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from keel_quantization.pdl import pdl_enter, pdl_kwargs
from keel_quantization.small_m_plan import SmallMPlan, fp8_plan
from keel_quantization.splitk_reduce import SplitKOutput, split_range


@triton.jit
def _tile_dot(a, b, acc, UPCAST_DOT: tl.constexpr, HAS_A_SCALE: tl.constexpr, PROMOTE_K: tl.constexpr):
    """a [BM, BK] . b [BK, BN] (+ acc, None: a fresh sum) in float32; fp8 x fp8 sums promoted to float32 every
    PROMOTE_K inputs (None: the compiler's default, over the dot's K)."""
    # One if / elif / else, not early returns: Triton's code generator still builds (and checks) what follows a
    # return in a constexpr branch, so the fp8 dot below an upcast 16-wide K tile failed sm_90's K >= 32 check
    if UPCAST_DOT:  # the interpreter has no fp8 dot, float32 none in bf16: the same products in float32
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif HAS_A_SCALE:
        out = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE_K)
    else:  # weight-only: widen the fp8 tile to the activations' dtype
        out = tl.dot(a, b.to(a.dtype), acc)
    return out


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr,
    M, N, K, K_PER_SPLIT,  # split s (program_id 2) covers inputs [s * K_PER_SPLIT, (s + 1) * K_PER_SPLIT)
    stride_am, stride_ak, stride_asm, stride_ask, stride_bn, stride_bk, stride_bsn, stride_bsk,
    stride_cs, stride_cm, stride_cn,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, UPCAST_DOT: tl.constexpr, HAS_A_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
    # one scale per row over all of K (GROUP_K >= K, GROUP_N 1): the tiles' products are summed in the
    # accumulator (fp8 sums promoted to float32 every K tile, as the per-tile form's fresh dot does) and
    # scaled once after the loop, not each K tile (2 multiplies and an add per output element a tile, with
    # the MMA waited for before them). Precision: promotion every 128 inputs measured 1.9e-4 of |y| in the
    # small-M GEMM (docs/architecture.md), every 32 5.3e-5 at 4x the adds; a route to it decides which
    # against cuBLAS's numbers, not only its speed
    SCALE_AFTER: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k_start, k_end = split_range(tl.program_id(2), K, K_PER_SPLIT)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < k_end
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK] fp8 (or the model dtype)
        b = tl.load(b_ptr + offs_n[None, :] * stride_bn + k[:, None] * stride_bk,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BK, BN] fp8
        if SCALE_AFTER:
            acc = _tile_dot(a, b, acc, UPCAST_DOT, HAS_A_SCALE, BLOCK_K)
        else:
            g = k0 // GROUP_K
            b_s = tl.load(bs_ptr + (offs_n // GROUP_N) * stride_bsn + g * stride_bsk, mask=mask_n,
                          other=0.0)  # [BN]
            part = _tile_dot(a, b, None, UPCAST_DOT, HAS_A_SCALE, None)
            if HAS_A_SCALE:
                a_s = tl.load(as_ptr + offs_m * stride_asm + g * stride_ask, mask=mask_m, other=0.0)  # [BM]
                part = part * a_s[:, None]
            acc += part * b_s[None, :]
    if SCALE_AFTER:
        acc *= tl.load(bs_ptr + offs_n * stride_bsn, mask=mask_n, other=0.0)[None, :]
        if HAS_A_SCALE:
            acc *= tl.load(as_ptr + offs_m * stride_asm, mask=mask_m, other=0.0)[:, None]
    c_ptr += tl.program_id(2) * stride_cs  # one split: y itself; more: this split's float32 partials
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _tiles(m: int, group_k: int, k: int) -> SmallMPlan:
    block_k = 128 if group_k >= k else min(128, group_k)
    if m <= 16:
        return SmallMPlan("dot", 16, 64, block_k)
    return SmallMPlan("dot", 32, 64, block_k) if m <= 64 else SmallMPlan("dot", 64, 128, block_k)


def dot_constexprs(plan: SmallMPlan, group_n: int, group_k: int, a_dtype: torch.dtype, has_a_scale: bool,
                   on_cpu: bool, scale_after: bool = False) -> dict:
    """The "dot" kernel's constexprs for these operands, as `_launch` passes them; the sm_90 compile test builds the
    variants real layouts get through this function, so what it compiles is what a GPU launch would."""
    # the interpreter has no fp8 dot; fp8 MMA instructions take K tiles of 32 and more
    upcast = on_cpu or plan.block_k < 32 or a_dtype == torch.float32
    return {"GROUP_N": group_n, "GROUP_K": group_k, "UPCAST_DOT": upcast, "HAS_A_SCALE": has_a_scale,
            "BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n, "BLOCK_K": plan.block_k, "SCALE_AFTER": scale_after}


def _check(a: torch.Tensor, a_groups: int | None, b_q: torch.Tensor, b_s: torch.Tensor, group_n: int,
           group_k: int, name: str) -> None:
    k = a.shape[1]
    n = b_q.shape[0]
    groups = -(-k // group_k)
    if (b_q.shape[1] != k or b_s.shape[0] != -(-n // group_n) or b_s.shape[1] != groups
            or a_groups not in (None, groups)):
        raise ValueError(f"{name}: shapes do not fit: a {tuple(a.shape)}, a groups {a_groups}, b "
                         f"{tuple(b_q.shape)}, b_s {tuple(b_s.shape)}, groups ({group_n}, {group_k})")


def _launch(a, a_s, b_q, b_s, group_n, group_k, out_dtype, plan: SmallMPlan, out,
            scale_after: bool = False) -> torch.Tensor:
    # scale_after: the "dot" kernel's SCALE_AFTER (one scale per row over K only); benchmarks/h200_fp8_mid_m.py
    # times it against the per-tile form, nothing routes to it yet
    m, k = a.shape
    n = b_q.shape[0]
    bm, bn, bk = plan.block_m, plan.block_n, plan.block_k
    if group_k < k and group_k % bk:
        raise ValueError(f"fp8_gemm: BLOCK_K {bk} must divide the scale group {group_k}")
    if scale_after and (group_k < k or group_n != 1 or plan.kernel != "dot"):
        raise ValueError(f"fp8_gemm: scale_after takes one scale per row over K and the dot kernel, not groups "
                         f"({group_n}, {group_k}) of K {k} on {plan.kernel!r}")
    y = torch.empty(m, n, dtype=out_dtype, device=a.device) if out is None else out
    if m == 0:
        return y
    dst = SplitKOutput(y, k, bk, plan.split_k)
    (scs, scm, scn), options = dst.strides, plan.launch_options()
    if plan.kernel == "gemv_fold":
        raise ValueError("fp8_gemm: the gemv_fold kernel is int4 only")
    if plan.kernel == "gemv":
        if a_s is not None:
            raise ValueError("fp8_gemm: the gemv kernel is weight-only (no activation scales)")
        from keel_quantization.fp8_gemv_triton import _fp8_gemv_kernel, launch_args

        _fp8_gemv_kernel[(triton.cdiv(n, bn), dst.splits, triton.cdiv(m, bm))](
            a, b_q, b_s, dst.buf, m, n, k, dst.k_per_split, a.stride(0), a.stride(1), b_q.stride(0), b_q.stride(1),
            b_s.stride(0), b_s.stride(1), scs, scm, scn,
            GROUP_N=group_n, GROUP_K=group_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SCALE_AFTER=group_k >= k,
            **launch_args(plan), **pdl_kwargs(a))
        return dst.finish()
    consts = dot_constexprs(plan, group_n, group_k, a.dtype, a_s is not None, a.device.type == "cpu", scale_after)
    a_s = b_s if a_s is None else a_s  # unread without HAS_A_SCALE
    _fp8_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), dst.splits)](
        a, a_s, b_q, b_s, dst.buf, m, n, k, dst.k_per_split,
        a.stride(0), a.stride(1), a_s.stride(0), a_s.stride(1), b_q.stride(0), b_q.stride(1),
        b_s.stride(0), b_s.stride(1), scs, scm, scn, **consts, **options, **pdl_kwargs(a),
    )
    return dst.finish()


def fp8_gemm(
    a_q: torch.Tensor,  # e4m3 [M, K]
    a_s: torch.Tensor,  # float32 [M, ceil(K / group_k)]
    b_q: torch.Tensor,  # e4m3 [N, K]
    b_s: torch.Tensor,  # float32 [ceil(N / group_n), ceil(K / group_k)]
    group_n: int,
    group_k: int,
    out_dtype: torch.dtype,
    tiles: tuple[int, int, int] | None = None,  # (BLOCK_M, BLOCK_N, BLOCK_K); tests pick small ones
    out: torch.Tensor | None = None,  # [M, N] in out_dtype, written in full
) -> torch.Tensor:  # [M, N]
    if a_s.shape[0] != a_q.shape[0]:
        raise ValueError(f"fp8_gemm: a {tuple(a_q.shape)} has scales {tuple(a_s.shape)}")
    _check(a_q, a_s.shape[1], b_q, b_s, group_n, group_k, "fp8_gemm")
    m, k = a_q.shape
    plan = SmallMPlan("dot", *tiles) if tiles else _tiles(m, group_k, k)
    return _launch(a_q, a_s, b_q, b_s, group_n, group_k, out_dtype, plan, out)


def fp8_weight_only_gemm(
    x: torch.Tensor,  # [M, K] in the model dtype
    b_q: torch.Tensor,  # e4m3 [N, K]
    b_s: torch.Tensor,  # float32 [ceil(N / group_n), ceil(K / group_k)]
    group_n: int,
    group_k: int,
    tiles: tuple[int, int, int] | None = None,  # (BLOCK_M, BLOCK_N, BLOCK_K) of the dot kernel; tests pick small ones
    out: torch.Tensor | None = None,  # [M, N] in x's dtype, written in full
    plan: SmallMPlan | None = None,  # kernel, tiles, K split; default small_m_plan.fp8_plan (per shape)
) -> torch.Tensor:  # [M, N] in x's dtype
    _check(x, None, b_q, b_s, group_n, group_k, "fp8_weight_only_gemm")
    m, k = x.shape
    if plan is None:
        plan = SmallMPlan("dot", *tiles, num_stages=4) if tiles else fp8_plan(m, b_q.shape[0], k, group_k)
    return _launch(x, None, b_q, b_s, group_n, group_k, x.dtype, plan, out)
