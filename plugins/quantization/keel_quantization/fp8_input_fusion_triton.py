"""FP8 activation quantization fused into the layer that produces a W8A8 linear layer's input (RMSNorm before
qkv / gate_up, SiluAndMul before down; `keel.layers.input_quant`): one launch writes e4m3 values and their
per-token scale where two launches wrote the model-dtype activations and then read them back to quantize.

The numbers are the unfused pair's, bit for bit: each kernel rounds its result to the model dtype exactly where
kernels-triton's `rms_norm_kernel` / `silu_and_mul_kernel` round (the norm with the same tile and warps, so the
same sum order), then quantizes those values as `fp8_quant_triton.quant_fp8` does (float32 amax, IEEE division,
e4m3 round-to-nearest-even) -- so a request's tokens do not depend on whether its step was fused (steps of
at most the layer's small-M bound are not).

One scale per token (dynamic), per token and group (block fp8), or the layer's static input scale. A token's row is
held whole (the norm: hidden sizes up to MAX_NORM_WIDTH; the SiluAndMul up to MAX_SILU_ROW outputs, walked twice in
chunks past it: the amax, then the values again, recomputed) -- or, with groups, each program takes a chunk of the
row, its groups independent. For cuBLAS's block-scaled GEMM the outputs are written in its layout (`_outputs`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from keel.layers.fp8_utils import FP8
from keel_quantization.fp8_quant_triton import _dynamic_scale, _reciprocal, _to_e4m3_stored
from keel_quantization.pdl import pdl_enter, pdl_kwargs

# Whether this module's kernels were jitted for the interpreter (triton.jit decides as it decorates them)
_INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret)

MAX_NORM_WIDTH = 8192  # kernels-triton's one-tile norm; wider rows are not fused
# The grouped norm's inputs per pass. At 8192 x 4096 on an H100 (h100-fp8-input-fusion-1b41e57): 89.8 us a launch
# in one pass of 4096, 138.6 in passes of 1024, 344.9 of 256, against 128.0 for the unfused pair (norm, then
# quant_fp8 in cuBLAS's layout) and 664.9 for the first version (the row's registers reshaped to [32, 128]); 7168
# wide: 185.5 in passes of 4096 against 231.0 unfused. At 256 rows 4.7 us against 5.1 (4096 wide).
NORM_GROUP_CHUNK = 4096


@triton.jit
def _round_to(x, dt: tl.constexpr):
    """float32 `x` rounded to `dt` to nearest-even, as torch rounds. Compiled, the conversion itself does (cvt.rn),
    so the bits are rounded by hand only in the interpreter, which truncates to bfloat16. By hand on CUDA they cost
    ~6 integer instructions an element and turned its canonical NaN (0x7FFFFFFF) into -0.0; left to the compiler,
    a bf16 product or sum rounded so becomes one packed bf16 instruction (exact: float32 holds 2 x 8 + 2 bits).
    kernels-triton's `_round_to`, copied as `pdl` is, so this plugin needs no other plugin."""
    if dt == tl.bfloat16 and _INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dt)


@triton.jit
def _square(x):
    """float32 x * x rounded as a product, never contracted with the sum into an FMA (`mul.rn`). This and `_rstd`
    are kernels-triton's, so the norm is rms_norm_kernel's bit for bit whatever either launch's `enable_fp_fusion`."""
    if _INTERPRETED:
        return x * x
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _rstd(sum_sq, H, eps):
    """rsqrt(sum_sq / H + eps) with the add rounded on its own (`add.rn`), never fused with the division's multiply."""
    mean = sum_sq / H
    if _INTERPRETED:
        return tl.rsqrt(mean + eps)
    return tl.rsqrt(tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [mean, eps], dtype=tl.float32,
                                              is_pure=True, pack=1))


@triton.jit
def _quantize_groups(v, q_row, s_row, stride_sg, static_ptr, offs, mask, W, first_group, BLOCK: tl.constexpr,
                     GROUP: tl.constexpr, STATIC: tl.constexpr, HW_CVT: tl.constexpr):
    """Store BLOCK values v (float32, on the model dtype's grid; zeros past the row) at offs as e4m3 with one scale
    per GROUP inputs (GROUP >= BLOCK: one for them all; else BLOCK // GROUP groups from group `first_group`)."""
    if STATIC or GROUP >= BLOCK:  # one scale (static scales are one per tensor: GROUP >= BLOCK there too)
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            scale = _dynamic_scale(tl.max(tl.abs(v), axis=0))
        q = _to_e4m3_stored(v, scale, _reciprocal(scale), q_row.dtype.element_ty, HW_CVT, STATIC)
        tl.store(q_row + offs, q, mask=mask)
        tl.store(s_row + first_group * stride_sg, scale)
    else:
        v2 = tl.reshape(v, (BLOCK // GROUP, GROUP))
        scales = _dynamic_scale(tl.max(tl.abs(v2), axis=1))  # [BLOCK // GROUP]
        q = _to_e4m3_stored(v2, scales[:, None], _reciprocal(scales)[:, None], q_row.dtype.element_ty, HW_CVT,
                            False)
        tl.store(q_row + tl.reshape(offs, (BLOCK // GROUP, GROUP)), q, mask=tl.reshape(mask, (BLOCK // GROUP, GROUP)))
        first = first_group + tl.arange(0, BLOCK // GROUP)
        tl.store(s_row + first * stride_sg, scales, mask=first * GROUP < W)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, static_ptr,
    M, stride_x, stride_r, stride_q, stride_ro, stride_sm, stride_sg, H, eps,
    DT: tl.constexpr,  # the norm's output dtype (what the unfused norm stores)
    HAS_RESIDUAL: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
    CHUNK: tl.constexpr = 0,  # with groups: inputs quantized per pass
    PDL: tl.constexpr = False, HW_CVT: tl.constexpr = False,
):
    """One program a row. With groups the row's sum of squares comes from the row whole (the unfused norm's tile
    and warps: its sum order), then the row is read again (from L1) in [CHUNK // GROUP, GROUP] pieces and
    quantized: reshaping the row's registers to [groups, GROUP] instead ran 4-5x slower (NORM_GROUP_CHUNK)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    live = mask & ((row + offs * 0) < M)  # rows past x's (the padding cuBLAS's layout asks for): zeros in, zeros out
    x = _norm_input(x_ptr + row * stride_x, res_ptr + row * stride_r, res_out_ptr, offs, live, HAS_RESIDUAL)
    if HAS_RESIDUAL:
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=live)
    rstd = _rstd(tl.sum(_square(x.to(tl.float32)), axis=0), H, eps)
    q_row, s_row = q_ptr + row * stride_q, s_ptr + row * stride_sm
    if GROUP < BLOCK:
        o2 = tl.arange(0, CHUNK // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [groups, GROUP]
        for c in range(BLOCK // CHUNK):
            k = c * CHUNK + o2
            x2 = _norm_input(x_ptr + row * stride_x, res_ptr + row * stride_r, res_out_ptr, k,
                             (k < H) & ((row + k * 0) < M), HAS_RESIDUAL)
            v2 = _norm_output(x2, rstd, w_ptr, k, (k < H) & ((row + k * 0) < M), DT)
            scales = _dynamic_scale(tl.max(tl.abs(v2), axis=1))  # [groups]
            q = _to_e4m3_stored(v2, scales[:, None], _reciprocal(scales)[:, None], q_ptr.dtype.element_ty, HW_CVT,
                                False)
            tl.store(q_row + k, q, mask=k < H)
            first = c * (CHUNK // GROUP) + tl.arange(0, CHUNK // GROUP)
            tl.store(s_row + first * stride_sg, scales, mask=first * GROUP < H)
    else:
        v = _norm_output(x, rstd, w_ptr, offs, live, DT)
        _quantize_groups(v, q_row, s_row, stride_sg, static_ptr, offs, mask, H, 0, BLOCK, GROUP, STATIC, HW_CVT)


@triton.jit
def _norm_input(x_row, r_row, res_out_ptr, offs, live, HAS_RESIDUAL: tl.constexpr):
    """The norm's input at offs: x, or x + residual rounded to the residual output's dtype (zeros where not live)."""
    x = tl.load(x_row + offs, mask=live, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_row + offs, mask=live, other=0.0)
        x = _round_to(x.to(tl.float32) + r.to(tl.float32), res_out_ptr.dtype.element_ty)
    return x


@triton.jit
def _norm_output(x, rstd, w_ptr, offs, live, DT: tl.constexpr):
    """The unfused norm's output at offs, as float32 on DT's grid: x * rstd rounded to x's dtype, times the weight,
    rounded to DT; +0 where not live (padding rows), not w * 0's -0."""
    y = _round_to(x.to(tl.float32) * rstd, x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=live, other=0.0)
    return tl.where(live, _round_to(w.to(tl.float32) * y, DT).to(tl.float32), 0.0)


@triton.jit
def _exp_neg(g):
    """exp(-g) as tl.exp(-g) compiles it, ex2(RN(g * -log2(e))), in two instructions: the product with the negated
    constant (tl.exp negated g first, a separate add) and the flush-to-zero ex2, which differs from tl.exp's only
    where the result is subnormal (g > 87) -- there 1 + exp(-g) is 1 either way (the silu, its only use).
    kernels-triton's twin."""
    if _INTERPRETED:
        return tl.exp(-g)
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [g * -1.4426950408889634],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _silu_mul(x_row, offs, mask, D, DT: tl.constexpr):
    g = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_row + D + offs, mask=mask, other=0.0).to(tl.float32)
    s = _round_to(g / (1.0 + _exp_neg(g)), DT).to(tl.float32)
    return _round_to(s * u, DT).to(tl.float32)


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr, q_ptr, s_ptr, static_ptr, M, stride_x, stride_q, stride_sm, stride_sg, D,
    DT: tl.constexpr, STATIC: tl.constexpr, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, GROUP: tl.constexpr,
    PDL: tl.constexpr = False, HW_CVT: tl.constexpr = False,
):
    """One scale per token (GROUP >= D: a program walks the row, in one chunk or twice in NUM_CHUNKS) or per GROUP
    inputs (program_id(1) picks the row's chunk, CHUNK a multiple of GROUP)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    s_row = s_ptr + row * stride_sm
    cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    in_x = (row + cols * 0) < M  # rows past x's (cuBLAS's padding): zeros in, zeros out
    if NUM_CHUNKS == 1:
        mask = cols < D
        v = _silu_mul(x_row, cols, mask & in_x, D, DT)
        _quantize_groups(v, q_row, s_row, stride_sg, static_ptr, cols, mask, D, tl.program_id(1) * (CHUNK // GROUP),
                         CHUNK, GROUP, STATIC, HW_CVT)
    else:
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            amax = tl.zeros((CHUNK,), dtype=tl.float32)
            for c in range(NUM_CHUNKS):
                k = c * CHUNK + cols
                amax = tl.maximum(amax, tl.abs(_silu_mul(x_row, k, (k < D) & in_x, D, DT)))
            scale = tl.max(_dynamic_scale(amax), axis=0)  # monotone in the amax: the largest chunk's is the token's
        rcp = _reciprocal(scale)
        for c2 in range(NUM_CHUNKS):
            k2 = c2 * CHUNK + cols
            v = _silu_mul(x_row, k2, (k2 < D) & in_x, D, DT)
            q = _to_e4m3_stored(v, scale, rcp, q_ptr.dtype.element_ty, HW_CVT, STATIC)
            tl.store(q_row + k2, q, mask=k2 < D)
        tl.store(s_row, scale)


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _outputs(m: int, width: int, group: int | None, pad_to: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M', width], float32 scales [M', groups]) with M' = m rounded up to pad_to; pad_to > 1 is cuBLAS's
    block-scaled layout (`fp8_cublas_block.quantize_activations`): scales token-major, strides (1, M')."""
    rows = -(-m // pad_to) * pad_to
    groups = 1 if group is None else -(-width // group)
    q = torch.empty(rows, width, dtype=FP8, device=device)
    if pad_to > 1:
        return q, torch.empty(groups, rows, dtype=torch.float32, device=device).t()
    return q, torch.empty(rows, groups, dtype=torch.float32, device=device)


def _check_group(group: int | None, static_scale: torch.Tensor | None) -> None:
    if group is not None and (group & (group - 1) or static_scale is not None):
        raise ValueError(f"fp8 input fusion: groups of {group} (a power of two, dynamic scales only)")


def rms_norm_quant(
    x: torch.Tensor,  # [M, H], contiguous last dim
    residual: torch.Tensor | None,  # [M, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    static_scale: torch.Tensor | None,  # float32 [1]; None: dynamic
    group: int | None = None,  # inputs per dynamic scale; None: one per token
    pad_to: int = 1,  # rows rounded up to this (cuBLAS's layout, see _outputs)
    chunk: int | None = None,  # with groups: inputs quantized per pass (None: NORM_GROUP_CHUNK)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # (e4m3 [M', H], float32 [M', groups], new residual)
    _check_group(group, static_scale)
    x, residual = _rows(x), None if residual is None else _rows(residual)
    m, h = x.shape
    res_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = torch.promote_types(weight.dtype, res_dtype)  # what the unfused norm stores, as torch promotes
    q, s = _outputs(m, h, group, pad_to, x.device)
    res_out = torch.empty(m, h, dtype=res_dtype, device=x.device) if residual is not None else None
    if q.shape[0]:
        block = triton.next_power_of_2(h)  # kernels-triton's tile and warps: the same sum order
        grp = min(group or block, block)
        chunk = min(max(chunk or NORM_GROUP_CHUNK, grp), block)
        r = residual if residual is not None else x
        ro = res_out if res_out is not None else x
        _rms_norm_quant_kernel[(q.shape[0],)](
            x, r, weight, q, s, ro, s if static_scale is None else static_scale,
            m, x.stride(0), r.stride(0), q.stride(0), ro.stride(0), s.stride(0), s.stride(1), h, float(eps),
            DT=_TL[out_dtype], HAS_RESIDUAL=residual is not None, STATIC=static_scale is not None, BLOCK=block,
            GROUP=grp, CHUNK=chunk, num_warps=min(max(block // 256, 1), 16), HW_CVT=x.is_cuda, **pdl_kwargs(x),
        )
    return q, s, res_out


def silu_launch(m: int, d: int) -> tuple[int, int]:
    """(chunk, warps) of `silu_and_mul_quant` with one scale per token, m rows of d outputs: the row whole up to
    MAX_SILU_ROW (16 warps at 14336: 283.6 us at 8192 x 14336 on an H100 against 363.0 walking it twice in chunks
    of 2048 and 431.8 for the unfused pair; the fastest variant at every M from 64, h100-fp8-input-fusion-4c3d8ad),
    walked twice in chunks of 2048 past it (unmeasured)."""
    if d > MAX_SILU_ROW:
        return 2048, 8
    chunk = triton.next_power_of_2(d)
    return chunk, min(max(chunk // 1024, 4), 16)


MAX_SILU_ROW = 16384
GROUP_CHUNK = 1024  # inputs a program quantizes in groups (several groups, one pass)


def silu_and_mul_quant(
    x: torch.Tensor,  # [M, 2 * D], contiguous last dim: gate, then up
    static_scale: torch.Tensor | None,  # float32 [1]; None: dynamic
    chunk: int | None = None,  # inputs a program walks at a time (None: `silu_launch`'s)
    warps: int | None = None,
    group: int | None = None,  # inputs per dynamic scale; None: one per token
    pad_to: int = 1,  # rows rounded up to this (cuBLAS's layout, see _outputs)
) -> tuple[torch.Tensor, torch.Tensor]:  # (e4m3 [M', D], float32 [M', groups])
    _check_group(group, static_scale)
    x = _rows(x)
    m, d = x.shape[0], x.shape[1] // 2
    q, s = _outputs(m, d, group, pad_to, x.device)
    if q.shape[0]:
        if group is not None and group < d:  # independent groups: a program per row chunk, one pass
            chunk = chunk or max(group, min(GROUP_CHUNK, triton.next_power_of_2(d)))
            grid, num_chunks, warps = (q.shape[0], triton.cdiv(d, chunk)), 1, warps or 4
        else:
            default_chunk, default_warps = silu_launch(m, d)
            chunk = chunk or default_chunk
            warps = warps or (default_warps if chunk == default_chunk else 4)
            grid, num_chunks = (q.shape[0], 1), triton.cdiv(d, chunk)
        _silu_and_mul_quant_kernel[grid](
            x, q, s, s if static_scale is None else static_scale, m, x.stride(0), q.stride(0), s.stride(0),
            s.stride(1), d, DT=_TL[x.dtype], STATIC=static_scale is not None, CHUNK=chunk, NUM_CHUNKS=num_chunks,
            GROUP=min(group or chunk, chunk), num_warps=warps, HW_CVT=x.is_cuda, **pdl_kwargs(x),
        )
    return q, s
