"""Int4 GEMV with the zero point folded out of the inner loop: per weight element a nibble extraction and
one multiply-add (decode, M of a few rows; no tensor cores).

Same layout as `int4_triton` (qweight int32 [K / 8, N], input k in bits 4 * (k % 8) of word k // 8;
scales / zeros [groups, N]) and the same grid and split-K contract as `int4_gemv_triton`; launched by
`int4_triton.int4_gemm` with a "gemv_fold" `SmallMPlan`. Why: the plain GEMV's loop is ~13 sm_90 SASS
instructions per weight element (shift, mask, magic subtract, zero subtract, scale multiply, FMA, plus
activation loads / conversions and a register shuffle per element), the dot plan's ~7.7 (with an I2F
per element); at ~0.9 TB/s both are bound by issuing instructions, not by the weight's bytes.

The math, for one K tile lying in one scale group (GROUP > 0), output n, row m:
    sum_k x_k (q_k - z) s  =  256 s a,    a = (Q - z X) / 256,   Q = sum_k x_k q_k,   X = sum_k x_k.
Floats carrying q come from bit operations alone: one shift puts nibbles j, j + 1 (j even) of a word at
bits 15..18 and 19..22; masking each and or-ing in an exponent gives, exactly,
    lo = bits(1.0) | q_j << 15 = 1 + q_j / 256,     hi = bits(1/16) | q_{j+1} << 19 = 1/16 + q_{j+1} / 256,
so sum_j x_j v_j over a word = E + O / 16 + Q / 256, with E / O the sums of its even / odd inputs' x.
`a` starts at -(E + O / 16) - z (E + O) / 256 (per word row and column: E, O are per word row, shared
by every column) and takes one FMA per element; then total += 256 s a. Per element at M = 1: half a
shift, one mask-or (LOP3), one FMA, ~1/4 for the two per-word FMAs, ~1/2 for the activations (a load and
a bf16 -> f32 shift per input, shared over the thread's 4 columns) -- ~4.0 instructions in the SASS of
the 1x128x128 plan's loop (the exponents sit in registers, see below; immediates cost a MOV per LOP3).
A tile may also span whole groups (BLOCK_K a multiple of GROUP): s and z are then loaded per word row
(~+0.25 instructions per element) and a program runs fewer, longer tiles, reaching over K without a
split's second launch. Every output (or split partial) is written; rows past M read row M - 1, unstored.
Precision: `a` holds ~2 sum |x_j| per word while it carries (Q - z X) / 256, so float32 rounding costs
up to ~3.4e-4 sum_k |x_k| s_k (worst case, test_int4_gemv_fold's bound; ~1e-5 of |y| typically), far
below a bf16 output's rounding.

Loads in flight (the plan's num_stages, STAGES): Nsight Compute put this kernel at 18-35% of DRAM throughput on
the H200, latency-bound with one tile in flight a program (h200-ncu-small-m-a6116cd.json), and the launch's
num_stages did nothing: Triton's pipeliner takes a loop without a dot only from `tl.range(num_stages=...)`.
With it, the words and scales of STAGES - 1 tiles are copied ahead into shared memory (cp.async); the 2-byte
activation loads stay in the loop (cp.async moves 4-16 bytes). sm_90 SASS of 1x16x512: 56 -> 64 registers at 4
stages, 277 -> 303 loop instructions (2 barriers), 8 KB of shared memory a stage. Predicted (H200): Llama-8B's four
layers at M = 1 70.5 -> ~45-50 us. Measured (H100, h100-quant-small-m-pipelined-83ecae0.json): slower on every
layer (qkv 11.4 vs 9.3 us, down 21.4 vs 17.5, best of each): the loop still waits on its activations and pays the
barriers; no shipped plan pipelines it.

Gathered groups (GROUP == 0, desc_act g_idx out of order): scale and zero differ per input, nothing
folds; each element is x (q - z[g]) s[g] with q exact from the same floats. Correct, not fast.

Prediction (H200, unmeasured; benchmarks/h200_quant_small_m.py sweeps it): Llama-3-8B's four GEMMs
(218 M weight elements) at M = 1 ~40-50 us, against 140 us for the best plan measured and a 26.6 us
bytes floor: ~4.0 instructions per element at 4 warp-instructions / clock / SM, 132 SMs, ~1.75 GHz is
~29 us of issue, so memory (~75% of copy bandwidth, ~35 us) and the small layers' tails set it. M = 2 / 4
/ 8 / 16 cost ~6.8 / 10.3 / 16 / 28 instructions per element (one FMA per row and element more): ~55-65 /
80-95 / 120-130 / 200+ us; the dot plans (~142 us) should keep M >= 8.
"""

from __future__ import annotations

import triton
import triton.language as tl

from keel_quantization.pdl import pdl_enter
from keel_quantization.splitk_reduce import split_range


@triton.jit
def _nibble_pair(packed, j: tl.constexpr, one, sixteenth):
    """Floats (1 + q_j / 256, 1/16 + q_{j+1} / 256) of nibbles j, j + 1 (j even) of each word, shaped as
    `packed`: one shift puts nibble j at bits 15..18 and nibble j + 1 at bits 19..22; `one`, `sixteenth`
    are the bits of 1.0 and 1/16."""
    if j * 4 <= 15:
        t = packed << (15 - 4 * j)
    else:
        t = packed >> (4 * j - 15)  # arithmetic shift: the sign bits land above bit 22, masked off
    lo = ((t & 0x00078000) | one).to(tl.float32, bitcast=True)  # 1 + (q << 15) / 2^23
    hi = ((t & 0x00780000) | sixteenth).to(tl.float32, bitcast=True)  # (1 + (q << 19) / 2^23) / 16
    return lo, hi


@triton.jit
def _words(qw_ptr, k0, k_end, offs_w, offs_n, mask_n, stride_qk, stride_qn, EVEN: tl.constexpr):
    """Packed words [1, BK / 8, BN] int32 of the tile at input k0 (0 past k_end / N): loaded 3D, so the
    accumulators take the load's layout (no register shuffle per tile)."""
    words = k0 // 8 + offs_w
    ptrs = qw_ptr + words[None, :, None] * stride_qk + offs_n[None, None, :] * stride_qn
    if EVEN:
        packed = tl.load(ptrs)
    else:
        packed = tl.load(ptrs, mask=(words < k_end // 8)[None, :, None] & mask_n[None, None, :], other=0)
    return packed


@triton.jit
def _x_at(x_ptr, rows, k, mask_w, stride_xm, stride_xk, EVEN: tl.constexpr):
    """Float32 activations [BM, BK / 8, 1] of inputs k [BK / 8] (0 past the split; rows are clamped to
    real ones, their outputs never stored)."""
    ptrs = x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk
    if EVEN:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask_w[None, :], other=0.0)
    return x.to(tl.float32)[:, :, None]


@triton.jit
def _x_pair(x_ptr, rows, words, j: tl.constexpr, mask_w, stride_xm, stride_xk, EVEN: tl.constexpr):
    """Activations of inputs 8 * word + j and + j + 1, [BM, BK / 8, 1] each."""
    return (_x_at(x_ptr, rows, 8 * words + j, mask_w, stride_xm, stride_xk, EVEN),
            _x_at(x_ptr, rows, 8 * words + j + 1, mask_w, stride_xm, stride_xk, EVEN))


@triton.jit
def _fma_pair(a, packed, j: tl.constexpr, x_lo, x_hi, one, sixteenth):
    """a + x_j v_j + x_{j+1} v_{j+1} over nibbles j, j + 1 of each word: two FMAs per word and row."""
    lo, hi = _nibble_pair(packed, j, one, sixteenth)
    a += x_lo * lo
    a += x_hi * hi
    return a


@triton.jit
def _int4_gemv_fold_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, y_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_ys, stride_ym, stride_yn,
    GROUP: tl.constexpr,  # > 0: input k in group k // GROUP, a divisor or a multiple of BLOCK_K; 0: g_idx
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # BLOCK_K divides K and BLOCK_N divides N: no masks in the loop
    PDL: tl.constexpr = False,
    STAGES: tl.constexpr = 1,  # the plan's num_stages: > 1 pipelines the loop's loads through shared memory
):
    pdl_enter(PDL)
    pid_s = tl.program_id(1)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_m, M - 1)  # [BM] rows past M read row M - 1: no mask per load
    mask_n = offs_n < N
    k_start, k_end = split_range(pid_s, K, K_PER_SPLIT)
    # the exponents as values the compiler cannot fold (K_PER_SPLIT > 0, so the shift is 0): a mask-or
    # then takes its mask as the immediate and the exponent from a register held across the loop --
    # with both immediates ptxas re-materializes a constant register before ~every LOP3 (sm_90 SASS)
    one = 0x3F800000 + (K_PER_SPLIT >> 31)
    sixteenth = 0x3D800000 + (K_PER_SPLIT >> 31)
    offs_w = tl.arange(0, BLOCK_K // 8)
    # elementwise over (row, word row, column); summed over word rows once, after the loop
    total = tl.zeros((BLOCK_M, BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    # tl.range's num_stages, not the launch's: Triton pipelines a loop without a dot only when the loop asks
    # (sm_90 SASS: cp.async copies of STAGES - 1 tiles ahead, a DEPBAR at the loop top that leaves one stage's
    # loads in flight); a plain range compiles to one tile loaded and used per iteration at any num_stages
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        words = k0 // 8 + offs_w  # [BK / 8]
        mask_w = words < k_end // 8
        packed = _words(qw_ptr, k0, k_end, offs_w, offs_n, mask_n, stride_qk, stride_qn, EVEN)
        if GROUP >= BLOCK_K:  # one scale row for the tile
            sz = (k0 // GROUP) * stride_sg + offs_n * stride_sn
            s = tl.load(s_ptr + sz, mask=mask_n, other=0.0).to(tl.float32)[None, None, :]  # [1, 1, BN]
            z = tl.load(z_ptr + sz, mask=mask_n, other=0.0).to(tl.float32)[None, None, :]
        elif GROUP > 0:  # GROUP divides BLOCK_K: a scale row per word row
            sz = ((8 * words) // GROUP)[None, :, None] * stride_sg + offs_n[None, None, :] * stride_sn
            mask_sz = mask_w[None, :, None] & mask_n[None, None, :]  # word rows past K name no group
            s = tl.load(s_ptr + sz, mask=mask_sz, other=0.0).to(tl.float32)  # [1, BK / 8, BN]
            z = tl.load(z_ptr + sz, mask=mask_sz, other=0.0).to(tl.float32)
        if GROUP > 0:
            x0, x1 = _x_pair(x_ptr, rows, words, 0, mask_w, stride_xm, stride_xk, EVEN)  # [BM, BK / 8, 1]
            x2, x3 = _x_pair(x_ptr, rows, words, 2, mask_w, stride_xm, stride_xk, EVEN)
            x4, x5 = _x_pair(x_ptr, rows, words, 4, mask_w, stride_xm, stride_xk, EVEN)
            x6, x7 = _x_pair(x_ptr, rows, words, 6, mask_w, stride_xm, stride_xk, EVEN)
            even = (x0 + x2) + (x4 + x6)  # E, O: shared by every column of the word row
            odd = (x1 + x3) + (x5 + x7)
            # a = sum_j x_j v_j - (E + O / 16) - z X / 256 = (Q - z X) / 256, started at the subtrahend
            a = -(z * 0.00390625) * (even + odd) - (even + odd * 0.0625)  # [BM, BK / 8, BN]
            a = _fma_pair(a, packed, 0, x0, x1, one, sixteenth)
            a = _fma_pair(a, packed, 2, x2, x3, one, sixteenth)
            a = _fma_pair(a, packed, 4, x4, x5, one, sixteenth)
            a = _fma_pair(a, packed, 6, x6, x7, one, sixteenth)
            total += (256.0 * s) * a
        else:
            for j in tl.static_range(0, 8, 2):
                lo, hi = _nibble_pair(packed, j, one, sixteenth)
                for h in tl.static_range(2):
                    k = 8 * words + j + h
                    g = tl.load(g_ptr + k, mask=mask_w, other=0)
                    sz = g[None, :, None] * stride_sg + offs_n[None, None, :] * stride_sn
                    mkn = mask_w[None, :, None] & mask_n[None, None, :]
                    s = tl.load(s_ptr + sz, mask=mkn, other=0.0).to(tl.float32)  # [1, BK / 8, BN]
                    z = tl.load(z_ptr + sz, mask=mkn, other=0.0).to(tl.float32)
                    if h == 0:
                        q = (lo - 1.0) * 256.0  # exact small integers
                    else:
                        q = (hi - 0.0625) * 256.0
                    x = _x_at(x_ptr, rows, k, mask_w, stride_xm, stride_xk, EVEN)
                    total += x * ((q - z) * s)
    out = tl.sum(total, axis=1)  # [BM, BN]
    y_ptr += pid_s * stride_ys
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
             out.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & mask_n[None, :])
