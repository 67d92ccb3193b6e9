"""Fused FP8 (e4m3) activation quantization in Triton: one launch per linear input.

`quant_fp8(x, group, static_scale)`: x [M, K] in the model dtype -> (e4m3 [M, K], float32 scales
[M, ceil(K / group)]). Each program reads one token's group(s) once, takes the amax, writes the scale and
the fp8 values:
- dynamic per token and `group` inputs (block FP8, DeepSeek-V3): `group` = the weight's block columns;
- dynamic per token (per-channel / per-tensor weights, torch._scaled_mm row-wise): `group` = K;
- static (`input_scale` checkpoints): the given scale, written per token so _scaled_mm's row-wise
  operands have the shape they need.
Large tokens with one scale each and many rows take a second kernel that walks each token in chunks
(`choose_launch`, `QuantLaunch`): the same numbers, fewer registers. `out` may have more rows than x and
scales in any strides: cuBLAS's block-scaled GEMM takes them
token-major ([M, groups] with strides (1, M)) and M a multiple of 4 (`fp8_cublas_block`), so the rows
past x's are written as zeros (scale MIN_SCALE) in the same launch.

The numbers equal `keel.layers.fp8_utils.per_token_group_quant_fp8` (the torch reference) bit for bit:
the same float32 amax, IEEE divisions (`div_rn`: Triton's default float32 division is approximate), and
rounding to nearest-even on the e4m3 grid done in float32 before the cast. The explicit rounding makes
the cast exact, which also keeps the CPU interpreter right (it drops the carry of a mantissa that
rounds up into the next binade: 124.4 -> 64, not 128). Compiled for a GPU, the stored values skip it: the
hardware's saturating convert (cvt.rn.satfinite) clamps and rounds to nearest-even itself, the same bits
(`_to_e4m3_stored`). That is 1200 -> 784 sm_90 instructions for a 4096-input token at 4 warps (37.5 -> 24.5
an element; the IEEE division, kept for the reference's bits, is most of the rest). At 8192 x 4096 the
kernel ran 44 us on the H200 (8c848ae: ~2.3 TB/s, issue-bound); predicted ~28-32 us, unmeasured.
The division itself is `_quotient`: the scale's reciprocal once, then a product and two FMAs an element give the
IEEE quotient's bits (div_rn took ~12 instructions and a branch an element): 784 -> 472 instructions a thread for
that token. In the 8192-token fp8 prefill step on an H100 (no PDL) its 32 launches took 1.135 -> 1.048 ms,
~33 us each, its bytes at the copy bandwidth (h100-fp8-quotient-c06cd97.json).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from keel.layers.fp8_utils import FP8, FP8_MAX, MIN_SCALE
from keel_quantization.pdl import pdl_enter, pdl_kwargs

_SUBNORMAL = tl.constexpr(2.0**-6)  # e4m3's smallest normal; below it the grid is multiples of 2^-9
_MAGIC = tl.constexpr(1.5 * 2.0**14)  # float32 ulp here is 2^-9: (a + M) - M rounds a to that grid, ties to even
_MIN_SCALE = tl.constexpr(MIN_SCALE)
_FP8_MAX = tl.constexpr(FP8_MAX)
_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_SATURATED = tl.constexpr(2.0**16)  # a quotient past 464 stores as +-448: `_quotient` clamps its product here
# `_quotient` is exact for scales from here up (its remainder does not underflow while |x / scale| >= 2^-11):
# every dynamic scale (MIN_SCALE ~ 2^-17.8); a static one below takes the division
QUOTIENT_MIN_SCALE = 2.0**-92
_QUOTIENT_MIN_SCALE = tl.constexpr(QUOTIENT_MIN_SCALE)


@triton.jit
def _round_to_e4m3(v):
    """v float32 within [-448, 448] -> the nearest e4m3 value (ties to even), still float32."""
    bits = v.to(tl.int32, bitcast=True)
    # keep 3 of float32's 23 mantissa bits: add half an ulp (minus one when the kept LSB is even), truncate
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # 0xFFF00000
    a = tl.abs(v)
    subnormal = (a + _MAGIC) - _MAGIC
    # v's sign bit on the non-negative result, so -0.0 and -tiny stay negative (negating +0.0 compiled to +0.0)
    subnormal = (subnormal.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(a < _SUBNORMAL, subnormal, normal)


@triton.jit
def _dynamic_scale(amax):
    """amax float32 -> per_token_group_quant_fp8's scale, elementwise: amax / 448 (IEEE), at least MIN_SCALE."""
    return tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, _FP8_MAX, tl.float32)), _MIN_SCALE)


@triton.jit
def _to_e4m3(x, scale):
    """x float32 and its scale (broadcast to x's shape) -> x / scale saturated and rounded to e4m3, float32, by an
    IEEE division an element (the small-M GEMMs' inline quantization; the quantization kernels take `_quotient`)."""
    v = tl.math.div_rn(x, scale)
    return _round_to_e4m3(tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX))


@triton.jit
def _reciprocal(scale):
    """RN(1 / scale) (IEEE), elementwise: what `_quotient` multiplies by, taken once a scale."""
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def _quotient(x, scale, rcp, BOUNDED: tl.constexpr):
    """x / scale with div_rn's bits, x float32, scale > 0 and rcp = `_reciprocal(scale)` each a scalar or
    broadcast against x: q = RN(x * rcp) is within an ulp of the quotient, and one Markstein step,
    q - RN(q * scale - x) * rcp in two FMAs, rounds it correctly (Markstein 1990; Muller, Raina and Brisebarre,
    IEEE Trans. Computers 2004). Three instructions an element where div_rn took ~12 and a branch.
    - Exact while the remainder q * scale - x does not underflow: scale >= QUOTIENT_MIN_SCALE and
      |x / scale| >= 2^-11. Smaller quotients (|x| at most a few ulps off) store as e4m3 zeros either way.
    - The remainder is q * scale - x, not x - q * scale, and the correction multiplies it by -rcp, so that
      -0 / scale stays -0 (+0 + -0 is +0). -rcp is rcp's sign bit flipped: Triton compiles -r as 0 - r, which
      is +0 for r = +0 (on an H100 every -0 input came out +0).
    - An infinite scale (an amax of inf) gives x / inf (+-0, or NaN for inf / inf): the FMA takes FLT_MAX.
    - BOUNDED: |x| <= 448 * scale (a dynamic scale). Otherwise the product is clamped to 2^16 first, where it
      only saturates, so that it never overflows to inf (inf - inf would be NaN, not 448)."""
    q = x * rcp
    if not BOUNDED:
        q = tl.minimum(tl.maximum(q, -_SATURATED), _SATURATED)
    r = tl.math.fma(q, tl.minimum(scale, _FLT_MAX), -x)
    return tl.math.fma(r, _negated(rcp), q)


@triton.jit
def _negated(v):
    """-v with the sign bit flipped, so -(+0) is -0 (Triton's unary minus is 0 - v)."""
    return (v.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)


@triton.jit
def _scaled(x, scale, rcp, STATIC: tl.constexpr):
    """x / scale as `_quotient` gives it. A static scale (a scalar, any positive float32) below
    QUOTIENT_MIN_SCALE takes div_rn instead: a branch a program, not an element."""
    if STATIC:
        if scale >= _QUOTIENT_MIN_SCALE:
            v = _quotient(x, scale, rcp, False)
        else:
            v = tl.math.div_rn(x, tl.zeros(x.shape, tl.float32) + scale)
    else:  # dynamic: scale >= MIN_SCALE and |x| <= amax
        v = _quotient(x, scale, rcp, True)
    return v


@triton.jit
def _to_e4m3_stored(x, scale, rcp, dtype: tl.constexpr, HW_CVT: tl.constexpr, STATIC: tl.constexpr):
    """x / scale (`_scaled`; rcp = `_reciprocal(scale)`) saturated and rounded to the e4m3 `dtype` a kernel
    stores. HW_CVT (compiled for sm_89+): the quotient goes straight to the saturating round-to-nearest-even
    convert (cvt.rn.satfinite: the clamp and the rounding `_round_to_e4m3` spell out, in one instruction a pair)
    -- the same bits; the interpreter's convert is not exact, so it keeps the spelled-out rounding."""
    v = _scaled(x, scale, rcp, STATIC)
    if HW_CVT:
        return v.to(dtype)
    return _round_to_e4m3(tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX)).to(dtype)


@triton.jit
def _quant_fp8_kernel(
    x_ptr, q_ptr, s_ptr, static_ptr,
    M, K, GROUP, NUM_GROUPS,
    stride_xm, stride_xk, stride_qm, stride_qk, stride_sm, stride_sg,
    STATIC: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr, BLOCK_G: tl.constexpr,
    PDL: tl.constexpr = False,
    HW_CVT: tl.constexpr = False,  # the hardware's saturating convert rounds (`_to_e4m3_stored`)
):
    pdl_enter(PDL)
    row = tl.program_id(0)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)  # [G]
    cols = tl.arange(0, BLOCK_G)  # [BG]
    k = groups[:, None] * GROUP + cols[None, :]  # [G, BG]
    mask = (groups[:, None] < NUM_GROUPS) & (cols[None, :] < GROUP) & (k < K)
    # rows past x's (padding of `out`): zeros in, so a zero row and the smallest scale out
    in_x = (row + groups * 0) < M  # [G]
    x = tl.load(x_ptr + row * stride_xm + k * stride_xk, mask=mask & in_x[:, None], other=0.0).to(tl.float32)
    if STATIC:
        one = tl.load(static_ptr).to(tl.float32)  # the one static scale
        q = _to_e4m3_stored(x, one, _reciprocal(one), q_ptr.dtype.element_ty, HW_CVT, True)
        scale = tl.zeros([GROUPS_PER_PROGRAM], tl.float32) + one  # [G]
    else:
        scale = _dynamic_scale(tl.max(tl.abs(x), axis=1))  # [G]
        q = _to_e4m3_stored(x, scale[:, None], _reciprocal(scale)[:, None], q_ptr.dtype.element_ty, HW_CVT, False)
    tl.store(q_ptr + row * stride_qm + k * stride_qk, q, mask=mask)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups < NUM_GROUPS)


@triton.jit
def _quant_fp8_row_loop_kernel(
    x_ptr, q_ptr, s_ptr, static_ptr,
    M, K,
    stride_xm, stride_xk, stride_qm, stride_qk, stride_sm,
    STATIC: tl.constexpr, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    PDL: tl.constexpr = False,
    HW_CVT: tl.constexpr = False,
):
    """One scale per token, one token per program, K in chunks: a pass for the amax, a second one (the row
    again, from L2) to quantize -- a few registers per thread instead of the whole row's."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, CHUNK)
    in_x = (row + cols * 0) < M  # [CHUNK]; rows past x's (padding of `out`): zeros in -> zeros, smallest scale
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros((CHUNK,), dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            k = c * CHUNK + cols
            x = tl.load(x_ptr + row * stride_xm + k * stride_xk, mask=(k < K) & in_x, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        # the scale is monotone in the amax: the largest of the chunk's scales is the token's
        scale = tl.max(_dynamic_scale(amax), axis=0)
    rcp = _reciprocal(scale)
    for c in range(NUM_CHUNKS):
        k = c * CHUNK + cols
        x = tl.load(x_ptr + row * stride_xm + k * stride_xk, mask=(k < K) & in_x, other=0.0).to(tl.float32)
        q = _to_e4m3_stored(x, scale, rcp, q_ptr.dtype.element_ty, HW_CVT, STATIC)
        tl.store(q_ptr + row * stride_qm + k * stride_qk, q, mask=k < K)
    tl.store(s_ptr + row * stride_sm, scale)


@dataclass(frozen=True)
class QuantLaunch:
    """How `quant_fp8` launches: "tile" (a program holds whole groups in registers, several per program
    when they are small) or "loop" (one scale per token: a program walks its token in `chunk` inputs, twice).
    `warps` None: the tile launch's default (4, or 8 past 4096 inputs a program)."""

    kind: str = "tile"
    warps: int | None = None
    chunk: int = 2048


# The loop launch past this many inputs a token (one scale per token): the tile launch then holds 16384 floats a
# program (K 14336: 64 a thread at 8 warps), so few programs fit an SM and the loads of one cannot hide another's
# latency. 2048-input chunks at 8 warps were the fastest or near it at every M measured, on both cards
# (h200-fp8-act-quant-8c848ae.json, h100-fp8-act-quant-56d12d9.json; K 14336, us at M 64 / 256 / 1024 / 8192):
# H200 5.4 / 6.9 / 20.8 / 139.3 against the tile's 7.0 / 9.6 and the 4-warp loop's 20.6 / 149.9 it took from 512
# rows before; H100 4.6 / 5.6 / 19.5 / 154.6 against 5.4 / 6.8 / 28.8 / 188.1.
ROW_LOOP_MIN_K = 8192
# Up to this many rows the tile launch runs 16 warps a program: 15-35% faster than its default at M 64 and 256 for
# every (K, group) both sweeps measured (e.g. K 4096 per token, M 256: H200 3.15 against 3.80 us, H100 2.33 against
# 2.84; K 14336 in groups of 128, M 64: 3.83 against 5.52, 2.86 against 4.37); from 1024 rows no better.
TILE_W16_MAX_ROWS = 256


def choose_launch(rows: int, k: int, group: int) -> QuantLaunch:
    if group >= k and k >= ROW_LOOP_MIN_K:
        return QuantLaunch("loop", 8, 2048)
    return QuantLaunch("tile", 16) if rows <= TILE_W16_MAX_ROWS else QuantLaunch()


def quant_fp8(
    x: torch.Tensor,  # [M, K] in the model dtype
    group: int,  # inputs per scale group; K (or more) for one scale per token
    static_scale: torch.Tensor | None = None,  # float32 [1]: a static input_scale instead of dynamic scales
    # (q [M', K], scales [M', groups]) to write in full, M' >= M (padding rows), any strides; tests poison them
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    launch: QuantLaunch | None = None,  # None: `choose_launch` (benchmarks and tests pass their own)
) -> tuple[torch.Tensor, torch.Tensor]:  # (e4m3 [M', K], float32 scales [M', ceil(K / group)])
    m, k = x.shape
    group = min(group, k)
    num_groups = triton.cdiv(k, group)
    if static_scale is not None and num_groups != 1:
        raise ValueError(f"quant_fp8: a static scale is one per tensor; got group {group} of K {k}")
    if out is None:
        out = (torch.empty(m, k, dtype=FP8, device=x.device),
               torch.empty(m, num_groups, dtype=torch.float32, device=x.device))
    q, s = out
    rows = q.shape[0]
    if (rows < m or q.shape != (rows, k) or q.dtype != FP8 or s.shape != (rows, num_groups)
            or s.dtype != torch.float32):
        raise ValueError(f"quant_fp8: out ({tuple(q.shape)} {q.dtype}, {tuple(s.shape)} {s.dtype}) does not fit "
                         f"x {tuple(x.shape)} in groups of {group}")
    if rows == 0:
        return q, s
    launch = launch or choose_launch(rows, k, group)
    if launch.kind == "loop":
        if num_groups != 1:
            raise ValueError(f"quant_fp8: the loop launch takes one scale per token, not groups of {group} in {k}")
        _quant_fp8_row_loop_kernel[(rows,)](
            x, q, s, s if static_scale is None else static_scale, m, k,
            x.stride(0), x.stride(1), q.stride(0), q.stride(1), s.stride(0),
            STATIC=static_scale is not None, CHUNK=launch.chunk, NUM_CHUNKS=triton.cdiv(k, launch.chunk),
            num_warps=launch.warps or 4, HW_CVT=x.is_cuda, **pdl_kwargs(x),
        )
        return q, s
    block_g = triton.next_power_of_2(group)
    per_program = max(1, min(triton.next_power_of_2(num_groups), 4096 // block_g))  # ~4096 inputs a program
    elements = per_program * block_g
    grid = (rows, triton.cdiv(num_groups, per_program))
    _quant_fp8_kernel[grid](
        x, q, s, s if static_scale is None else static_scale,
        m, k, group, num_groups,
        x.stride(0), x.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1),
        STATIC=static_scale is not None, GROUPS_PER_PROGRAM=per_program, BLOCK_G=block_g,
        num_warps=launch.warps or (4 if elements <= 4096 else 8), HW_CVT=x.is_cuda, **pdl_kwargs(x),
    )
    return q, s

