"""Triton kernels of kernels-triton: (residual add +) RMSNorm, neox rope on q and k, MLA's rope (with the
latent's RMSNorm), SiluAndMul.

Each kernel reproduces the rounding steps of keel's native layer math (which mirrors HF): values are
widened to float32 for arithmetic and rounded back to the activation dtype exactly where the torch code
rounds (after the residual add, after normalizing, after each product in rope, after silu). So in bf16
the fused result differs from the native one only by reduction order and rsqrt's last bits.

All tensors are addressed as rows with an explicit row stride and a contiguous last dimension. Every kernel
starts with `pdl_enter(PDL)` (see `pdl`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from keel_kernels_triton.pdl import pdl_enter

# Whether this module's kernels were jitted for the interpreter (triton.jit decides as it decorates them)
_INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret)


@triton.jit
def _round_to(x, dt: tl.constexpr):
    """float32 `x` rounded to `dt` to nearest-even, as torch rounds. Compiled, the conversion itself does (cvt.rn),
    so the bits are rounded by hand only in the interpreter, which truncates to bfloat16. By hand on CUDA they cost
    ~6 integer instructions an element and turned its canonical NaN (0x7FFFFFFF) into -0.0; left to the compiler,
    a bf16 product or sum rounded so becomes one packed bf16 instruction (exact: float32 holds 2 x 8 + 2 bits)."""
    if dt == tl.bfloat16 and _INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dt)


@triton.jit
def _square(x):
    """float32 x * x, rounded as a product even where the launch lets the compiler contract a multiply and an add
    into an FMA (`mul.rn` is never contracted): an RMSNorm's sum of squares is then the same in every kernel that
    takes one, whatever each launch's `enable_fp_fusion` (the MLA rope-norm launches without contraction for its
    rope, rms_norm_kernel with it), and it is torch's: the squares rounded, then summed. The interpreter multiplies
    in numpy, which never contracts."""
    if _INTERPRETED:
        return x * x
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _rstd(sum_sq, H, eps):
    """rsqrt(sum_sq / H + eps), the add rounded on its own (`add.rn`): the division compiles to a reciprocal and a
    multiply, which a launch with contraction fused with the add (an FFMA in sm_90 SASS) and one without did not."""
    mean = sum_sq / H
    if _INTERPRETED:
        return tl.rsqrt(mean + eps)
    return tl.rsqrt(tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [mean, eps], dtype=tl.float32,
                                              is_pure=True, pack=1))


@triton.jit
def _norm_row(x, w_ptr, o_row, offs, mask, H, eps):
    """One row held in registers (`x` at `offs`, zero where masked): weight * norm(x) stored at `o_row`."""
    xf = x.to(tl.float32)
    rstd = _rstd(tl.sum(_square(xf), axis=0), H, eps)
    y = _round_to(xf * rstd, x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_row + offs, _round_to(w * y, o_row.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_kernel(
    x_ptr,  # [rows, H] (row stride stride_x)
    res_ptr,  # [rows, H] residual in (only read when HAS_RESIDUAL)
    w_ptr,  # [H]
    out_ptr,  # [rows, H]
    res_out_ptr,  # [rows, H] new residual = x + residual (only written when HAS_RESIDUAL)
    stride_x, stride_r, stride_o, stride_ro,
    H, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = res_ptr + row * stride_r
    ro_row = res_out_ptr + row * stride_ro
    o_row = out_ptr + row * stride_o
    if SINGLE:
        # One pass: the row stays in registers between the sum of squares and the scaling.
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        x = tl.load(x_row + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_row + offs, mask=mask, other=0.0)
            x = _round_to(x.to(tl.float32) + r.to(tl.float32), res_out_ptr.dtype.element_ty)
            tl.store(ro_row + offs, x, mask=mask)
        _norm_row(x, w_ptr, o_row, offs, mask, H, eps)
    else:
        # Rows wider than one tile: sum in a first sweep (writing the new residual), scale in a second.
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, H, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < H
            x = tl.load(x_row + offs, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(r_row + offs, mask=mask, other=0.0)
                x = _round_to(x.to(tl.float32) + r.to(tl.float32), res_out_ptr.dtype.element_ty)
                tl.store(ro_row + offs, x, mask=mask)
            acc += _square(x.to(tl.float32))
        rstd = _rstd(tl.sum(acc, axis=0), H, eps)
        # Fresh names in the second sweep: nothing here is carried over from the first loop.
        for start2 in range(0, H, BLOCK):
            offs2 = start2 + tl.arange(0, BLOCK)
            mask2 = offs2 < H
            if HAS_RESIDUAL:
                v = tl.load(ro_row + offs2, mask=mask2, other=0.0)
            else:
                v = tl.load(x_row + offs2, mask=mask2, other=0.0)
            y2 = _round_to(v.to(tl.float32) * rstd, v.dtype).to(tl.float32)
            w2 = tl.load(w_ptr + offs2, mask=mask2, other=0.0).to(tl.float32)
            tl.store(o_row + offs2, _round_to(w2 * y2, out_ptr.dtype.element_ty), mask=mask2)


@triton.jit
def _rope_heads(
    x_ptr, out_ptr, stride_x, stride_o, stride_xh, stride_oh, token, cos, sin, num_heads,
    HEAD: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    # cos/sin: [1, BLOCK_HALF] float32 holding values already rounded to the activation dtype.
    # Head h of the token's row starts at h * stride_xh (in) / h * stride_oh (out). INTERLEAVED reads
    # the rotated dims de-interleaved: evens as the first half, odds as the second (a copy in torch).
    hh = tl.arange(0, BLOCK_H)[:, None]
    dd = tl.arange(0, BLOCK_HALF)[None, :]
    x_row = x_ptr + token * stride_x
    o_row = out_ptr + token * stride_o
    dt = out_ptr.dtype.element_ty
    if INTERLEAVED:
        first, second = 2 * dd, 2 * dd + 1
    else:
        first, second = dd, HALF + dd
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + hh
        mask = (h < num_heads) & (dd < HALF)
        x1 = tl.load(x_row + h * stride_xh + first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + h * stride_xh + second, mask=mask, other=0.0).to(tl.float32)
        # torch: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the activation dtype.
        a1 = _round_to(x1 * cos, dt).to(tl.float32)
        b1 = _round_to(x2 * sin, dt).to(tl.float32)
        a2 = _round_to(x2 * cos, dt).to(tl.float32)
        b2 = _round_to(x1 * sin, dt).to(tl.float32)
        tl.store(o_row + h * stride_oh + dd, _round_to(a1 - b1, dt), mask=mask)
        tl.store(o_row + h * stride_oh + HALF + dd, _round_to(a2 + b2, dt), mask=mask)
        if ROT < HEAD:  # partial rotary: the tail of each head passes through
            pp = tl.arange(0, BLOCK_PASS)[None, :]
            pmask = (h < num_heads) & (pp < HEAD - ROT)
            tail = tl.load(x_row + h * stride_xh + ROT + pp, mask=pmask, other=0.0)
            tl.store(o_row + h * stride_oh + ROT + pp, tail.to(dt), mask=pmask)


@triton.jit
def _cos_sin(pos_ptr, cos_ptr, sin_ptr, token, dt: tl.constexpr, ROT: tl.constexpr, HALF: tl.constexpr,
             BLOCK_HALF: tl.constexpr):
    """The token's cos / sin halves as [1, BLOCK_HALF] float32, rounded to `dt` first as the torch path
    casts them to the activation dtype before multiplying."""
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dd = tl.arange(0, BLOCK_HALF)[None, :]
    cos = _round_to(tl.load(cos_ptr + pos * ROT + dd, mask=dd < HALF, other=0.0), dt).to(tl.float32)
    sin = _round_to(tl.load(sin_ptr + pos * ROT + dd, mask=dd < HALF, other=0.0), dt).to(tl.float32)
    return cos, sin


@triton.jit
def rotary_kernel(
    pos_ptr,  # [num_tokens] int
    q_ptr, k_ptr,  # [num_tokens, heads * HEAD] (row strides stride_q / stride_k)
    q_out_ptr, k_out_ptr,  # [num_tokens, heads * HEAD] contiguous
    cos_ptr, sin_ptr,  # [cache_len, ROT] float32 contiguous (the two halves are equal)
    stride_q, stride_k, stride_qo, stride_ko,
    num_q_heads, num_k_heads,
    HEAD: tl.constexpr, ROT: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(pos_ptr, cos_ptr, sin_ptr, token, q_out_ptr.dtype.element_ty, ROT, HALF, BLOCK_HALF)
    # Program (t, 0) rotates the token's q heads, (t, 1) its k heads.
    if tl.program_id(1) == 0:
        _rope_heads(q_ptr, q_out_ptr, stride_q, stride_qo, HEAD, HEAD, token, cos, sin, num_q_heads,
                    HEAD, HALF, ROT, BLOCK_H, BLOCK_HALF, BLOCK_PASS, False)
    else:
        _rope_heads(k_ptr, k_out_ptr, stride_k, stride_ko, HEAD, HEAD, token, cos, sin, num_k_heads,
                    HEAD, HALF, ROT, BLOCK_H, BLOCK_HALF, BLOCK_PASS, False)


@triton.jit
def mla_rope_kernel(
    pos_ptr,  # [num_tokens] int
    q_ptr,  # q's rope part: [num_tokens, heads, ROT] at row stride stride_q, head stride stride_qh
    k_ptr,  # [num_tokens, ROT] (row stride stride_k)
    q_out_ptr,  # [num_tokens, heads, ROT] contiguous
    k_out_ptr,  # [num_tokens, ROT] contiguous
    cos_ptr, sin_ptr,  # [cache_len, ROT] float32 contiguous
    stride_q, stride_qh, stride_k, num_heads,
    kv_ptr,  # [num_tokens, lora] (row stride stride_kv), the raw latent (read by programs (t, 2) only)
    kv_w_ptr,  # [lora] its RMSNorm weight
    kv_out_ptr,  # [num_tokens, lora] contiguous, the normalized latent
    stride_kv, lora, eps,
    ROT: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr, BLOCK_L: tl.constexpr = 16, PDL: tl.constexpr = False,
):
    """MLA's rope: q's rope parts read in place from the projection (no nope copy, no concatenation),
    de-interleaved on the load when INTERLEAVED. Program (t, 0) does the token's q heads, (t, 1) k_pe and,
    on a grid of 3 programs a token, (t, 2) the latent's RMSNorm (kv_a_layernorm: one kernel fewer in the
    layer's chain; BLOCK_L >= lora)."""
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    if part == 2:
        offs = tl.arange(0, BLOCK_L)
        mask = offs < lora
        x = tl.load(kv_ptr + token * stride_kv + offs, mask=mask, other=0.0)
        _norm_row(x, kv_w_ptr, kv_out_ptr + token * lora, offs, mask, lora, eps)
    else:
        cos, sin = _cos_sin(pos_ptr, cos_ptr, sin_ptr, token, q_out_ptr.dtype.element_ty, ROT, HALF, BLOCK_HALF)
        if part == 0:
            _rope_heads(q_ptr, q_out_ptr, stride_q, num_heads * ROT, stride_qh, ROT, token, cos, sin, num_heads,
                        ROT, HALF, ROT, BLOCK_H, BLOCK_HALF, 1, INTERLEAVED)
        else:
            _rope_heads(k_ptr, k_out_ptr, stride_k, ROT, ROT, ROT, token, cos, sin, 1,
                        ROT, HALF, ROT, 1, BLOCK_HALF, 1, INTERLEAVED)


@triton.jit
def _exp_neg(g):
    """exp(-g) as tl.exp(-g) compiles it, ex2(RN(g * -log2(e))), in two instructions: the product with the negated
    constant (tl.exp negated g first, a separate add) and the flush-to-zero ex2, which differs from tl.exp's only
    where the result is subnormal (g > 87) -- there 1 + exp(-g) is 1 either way (the silu, its only use)."""
    if _INTERPRETED:
        return tl.exp(-g)
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [g * -1.4426950408889634],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def silu_and_mul_kernel(
    x_ptr,  # [rows, 2 * D] (row stride stride_x): gate, then up
    out_ptr,  # [rows, D] (row stride stride_o)
    stride_x, stride_o, D,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    dt = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    # torch: silu in float32 rounded to the activation dtype, then the product rounded again.
    s = _round_to(g / (1.0 + _exp_neg(g)), dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, _round_to(s * u, dt), mask=mask)
