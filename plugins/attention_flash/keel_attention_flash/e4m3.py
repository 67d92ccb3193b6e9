"""e4m3 (float8_e4m3fn) quantization of the fp8 KV cache write, inside the write kernels.

`quantize_e4m3_bits(x, scale)` is the byte `keel.layers.kv_scales.quantize_kv` stores, bit for bit: x / scale by
IEEE division (Triton's default float32 division is approximate), saturated to +-448 with NaN kept (as
torch's clamp keeps it; tl.minimum / tl.maximum may drop it), rounded to nearest-even on the e4m3 grid in
float32, then encoded as the uint8 bits. The kernels store those bits into a uint8 view of the cache. Interpreted,
there is no fp8 cast at all, because Triton's CPU interpreter casts wrongly (it drops the carry of a mantissa
that rounds up into the next binade, 124.4 -> 64, and turns NaN into 384), and the encoding of a value already
on the grid is exact integer work. The quotient is `_quotient`'s: the IEEE bits from the scale's reciprocal and
two FMAs an element. Compiled, it goes to the hardware's saturating round-to-nearest-even
convert (cvt.rn.satfinite, as keel_quantization's HW_CVT path): the same bytes, ~1 instruction where the spelled-out
rounding took ~16 (the fp8 rope-and-cache write, sm_90 SASS: 968 -> 704 instructions a thread).

`round_to_e4m3` is a twin of keel_quantization.fp8_quant_triton._round_to_e4m3 (plugins are separate
distributions and never import each other); tests/test_e4m3.py keeps the two bit-equal.
"""

from __future__ import annotations

import triton
import triton.language as tl

from keel.layers.fp8_utils import FP8_MAX

# Whether this module's kernels were jitted for the interpreter (triton.jit decides as it decorates them)
_INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret)
_SUBNORMAL = tl.constexpr(2.0**-6)  # e4m3's smallest normal; below it the grid is multiples of 2^-9
_MAGIC = tl.constexpr(1.5 * 2.0**14)  # float32 ulp here is 2^-9: (a + M) - M rounds a to that grid, ties to even
_FP8_MAX = tl.constexpr(FP8_MAX)
_SATURATED = tl.constexpr(2.0**16)  # a quotient past 464 stores as +-448
_QUOTIENT_MIN_SCALE = tl.constexpr(2.0**-92)  # `_quotient`'s remainder does not underflow from here up


@triton.jit
def round_to_e4m3(v):
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
def _quotient(x, scale):
    """x / scale with div_rn's bits, scale a positive float32 scalar >= _QUOTIENT_MIN_SCALE: the reciprocal once,
    then q = RN(x * rcp), within an ulp, and one Markstein step, q - RN(q * scale - x) * rcp in two FMAs, which
    rounds it correctly while the remainder does not underflow (quotients past 2^-11; smaller ones store as zeros
    either way). The remainder q * scale - x times -rcp (its sign bit flipped: Triton's -r is 0 - r, +0 for
    r = +0) keeps -0 / scale at -0. The product is clamped to 2^16, where it only saturates, so that it never
    overflows (inf - inf would be NaN, not 448). Three instructions an element, and two compares, where div_rn
    took ~12 and a branch. The twin of keel_quantization's `_quotient` (static scales); tests/test_e4m3.py
    compares the bytes with quantize_kv's."""
    rcp = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    q = tl.minimum(tl.maximum(x * rcp, -_SATURATED), _SATURATED)
    r = tl.math.fma(q, scale, -x)
    return tl.math.fma(r, (rcp.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True), q)


@triton.jit
def quantize_e4m3_bits(x, scale):
    """x float32, scale a positive float32 scalar -> the float8_e4m3fn bits of torch's
    (x / scale).clamp(-448, 448).to(float8_e4m3fn), as uint8."""
    if scale >= _QUOTIENT_MIN_SCALE:  # a branch a program: the layer's one scale
        v = _quotient(x, scale)
    else:
        v = tl.math.div_rn(x, tl.zeros(x.shape, tl.float32) + scale)
    if not _INTERPRETED:  # compiled: the saturating round-to-nearest-even convert is the clamp and rounding below
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    v = tl.where(v > _FP8_MAX, _FP8_MAX, v)  # compares are false for NaN: it passes through
    v = tl.where(v < -_FP8_MAX, -_FP8_MAX, v)
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = round_to_e4m3(tl.abs(v))  # [0, 448] on the grid, or NaN
    abits = a.to(tl.int32, bitcast=True)
    # normal: float32's exponent rebiased 127 -> 7 next to its top 3 mantissa bits (the rest are 0 on the grid)
    normal = (abits >> 20) - (120 << 3)
    subnormal = (tl.where(a < _SUBNORMAL, a, 0.0) * 512.0).to(tl.int32)  # multiples of 2^-9: the mantissa
    mag = tl.where(a < _SUBNORMAL, subnormal, normal)
    # NaN: e4m3fn's only NaN code, with v's sign as torch keeps it. Tested on v itself, not on the rounded value:
    # CUDA's division returns the canonical NaN 0x7FFFFFFF, whose rounding add overflows to -0.0 (x86 keeps the
    # input's 0x7FC00000, which rounds to itself) -- on an H100 a NaN was stored as 0, never in the interpreter.
    mag = tl.where(v != v, 0x7F, mag)
    return (sign | mag).to(tl.uint8)
