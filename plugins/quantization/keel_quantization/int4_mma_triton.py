"""Int4 GEMM for mid-size steps (decode batches of 64-512 tokens) with the dequantized weight as the MMA's
register operand: y^T [N, M] = w [N, K] . x^T [K, M], w = (q - z) * s rounded to x's dtype per element --
the very numbers `int4_dequant_triton` writes, so the result is that dequantize + cuBLAS path's GEMM up to
float32 summation order, without writing and re-reading a bf16 copy of the weight.

Why: at a 256-token step keel's GPTQ runs the full dequantize then cuBLAS (`int4_linear.DEQUANT_GEMM_MIN_M`;
477 us over Llama-8B's four layers on the H200, the dequantize ~170 of it) and the throughput run reached 0.66x
vLLM's Machete on one GPTQ checkpoint (h100-vs-vllm-gptq-ckpt-fbd3fe2.json). The in-register tile GEMM
(`int4_triton`, x as the MMA's A) took 712 us there: on sm_90 the MMA's B operand must sit in shared memory,
so every dequantized weight tile is stored there and fenced before its MMA. Swapped, the weight rows are the
MMA's M dimension (BLOCK_N, 64 per warpgroup), an operand sm_90 takes from registers; the tokens are its N
dimension (BLOCK_M) and come from shared memory as the loads' pipeline puts them there.

Nibble planes: word w of a tile holds inputs 8w .. 8w + 7; plane j is [BLOCK_N, BLOCK_K / 8], input 8w + j of
each word: the nibble or-ed into the bits of 128.0 (bf16; 1024.0 fp16) is 128 + q, minus 128 + z is q - z
exactly, times s rounds the exact product once -- the dequantize pass's float32 numbers, in packed 16-bit math
(HADD2 / HMUL2 in the sm_90 SASS: 486 instructions a thread per 128 x 128 x 128 tile against 539 in float32,
`benchmarks/sass_mix.py --mma`; the interpreter, whose 16-bit arithmetic is not the GPU's, runs float32). The eight planes are joined into one [BLOCK_N, BLOCK_K] tile in the inputs' own
order and multiplied by one dot a K tile.

Measured and changed (H100 SXM, benchmarks/results/h100-int4-mma-553a477.json, Llama-8B's four layers): the
first version multiplied each plane by a dot of its own (x permuted into plane order to match). This
compiler waits for every MMA with a register operand before the next instruction (wgmma.wait_group 0), so the
eight planes' dequantize and MMAs ran in series: 1063 us at M = 256 against 745 for dequantize + cuBLAS (bf16
cuBLAS 301), 698 / 578 at M = 128, 1068 / 884 at 512; it won only gate_up at M = 128 (167 vs 240). Joined, the
sm_90 compile issues a tile's MMAs as one group and keeps one group in flight (wait_group 1) while the next
tile is loaded and dequantized; the joined tile reaches the MMA's register layout through stmatrix /
ldmatrix. `int4_linear` routes to it only where a measured plan file says so (`int4_mma_plans`); part
`int4-mma` measures it and writes that file. Prediction, from the sm_90 SASS (`benchmarks/sass_mix.py
--mma`): a thread issues ~490-540 instructions a K tile whatever the tile, so a 128 x 256 tile (8 warps) spends
~1040 issue clocks per scheduler against ~2050 of MMA and, overlapped, runs at the MMA's pace; 128 x 128 is
balanced (~970 / ~1020). Four layers at M = 256 on an H100 ~450-550 us (the small layers fill 32-48 of 132 SMs
at N / 128 programs) against dequantize + cuBLAS's 745; gate_up alone ~120 against 288. Measured at 415397c
(`h100-int4-mma-415397c.json`): 537 us with the best single tile (dequantize + cuBLAS 576 in that run), gate_up
208; with a tile per layer shape and K split across programs (e10cd51, `h100-int4-mma-e10cd51.json`) 499 --
still ~2x bf16 cuBLAS on a ready weight (247).

Pairs (`MmaTile.pairs`): the 16-bit dequantize above works a nibble plane at a time, and its packed math pairs
neighbouring outputs (the load's vector), so every pair of neighbouring inputs -- what one register of the MMA
operand holds -- is assembled by byte permutes (72 PRMT and ~50 moves a K tile in the sm_90 SASS). The pairs form
puts nibbles 2c and 2c + 1 of a word into the two halves of one int32 (the offset or-ed into both halves) and
reads that register as two 16-bit values (inline PTX, no instruction): the same numbers.
Measured at 0b309ac (H100): M 256, one tile, 649 -> 584 us (predicted -5 to -10%).
Its tile is built with the pair index c as a tensor axis ([BN, KW, 4, 2], `_pairs`), not as four tensors joined:
then this compiler lays the packed words out as the MMA operand wants them -- a thread holds every word of its two
rows (the four lanes of a quad read each word from shared memory), its lane picks c -- so the tile needs no layout
conversion. Joined, it went through shared memory each K tile: 8 STS.128, 8 LDSM and 5 CTA barriers a K tile in
the sm_90 SASS (Triton 3.6, `benchmarks/sass_mix.py --mma`), against none, none and 2 now, ~the same instruction
count (64 x 128: 454 -> 488, 128 x 128 x 8 warps: 435 -> 423). Predicted M 128-512 -10 to -25% a layer (the
barriers keeping a tile's dequantize from overlapping the MMAs before it), M 8-32 -5 to -10%. Measured at
ba3bbc6 (H100, `h100-int4-mma-ba3bbc6.json`): M 8-32 -8%, but from M 128 the best tile's time moved with the
instruction count, not the barriers (64 x 128 at M 128: 234 -> 248 us, +6% against +7% instructions; M 256 353
-> 353): the loop is bound by issuing instructions.
So a pair's extraction is now three instructions instead of five: one PRMT takes byte c of the word alone, a
multiply by 0x1001 copies its high nibble 12 bits up (b | b << 12), one LOP3 masks both nibbles and or-s in the
offset held in a register. Per pair the loop issues PRMT, IMAD, LOP3, HADD2, HMUL2 and the word's LDS: 64 x 128
488 -> 424 instructions a K tile, 128 x 128 x 8 warps 423 -> 359, 64 x 16 436 -> 372 (sm_90 SASS, Triton 3.6).
Prediction (unmeasured on a GPU): -10 to -13% a layer at every M the pairs entries serve.
Tried and left: loop-carried pointers for the tiles' loads (64 x 128 pairs 488 -> 534 instructions: the 64-bit
adds and the pipeliner's copies cost more than the multiply-adds they replace), and the activation tile by one
TMA copy a K tile (a [BLOCK_M, 128] bf16 box is wider than the 128-byte swizzle, so the tile reaches the MMA
through a register round trip: 359 -> 449 at 128 x 128, 20 barriers a K tile).

Tiles lie in one scale group (BLOCK_K divides the group, inputs in group order: act order is, once
`int4_linear` has permuted it); gathered groups and groups under 128 inputs are not served (`misfit` says
why; a caller keeps its other paths).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from keel_quantization.int4_dequant_triton import _TWO_23, dequant_plane
from keel_quantization.int4_mma_plans import MmaTile, misfit
from keel_quantization.int4_triton import _MAGIC
from keel_quantization.pdl import pdl_enter, pdl_kwargs
from keel_quantization.splitk_reduce import SplitKOutput, split_range


DEFAULT_TILE = MmaTile()


@triton.jit
def _plane(packed, j: tl.constexpr, zb, s, dtype: tl.constexpr, MAGIC16: tl.constexpr):
    """Nibble plane j of [BN, KW] packed words dequantized: (q - z) * s rounded to dtype (the dequantize's numbers).
    zb: 2^23 + z in float32 (MAGIC16 0), or OFFSET + z in dtype; s: float32, or dtype."""
    if MAGIC16:
        # 16-bit: the nibble or-ed into the bits of 128.0 (bf16) is 128 + q; minus 128 + z is q - z, exact; one
        # multiply by s rounds the exact product once, as the float32 path's conversion does
        q = (((packed >> (4 * j)) & 0xF) | MAGIC16).to(tl.int16).to(dtype, bitcast=True)
        return (q - zb) * s
    return dequant_plane(packed, j, zb, s).to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def _pairs(packed, zb, s, dtype: tl.constexpr, MAGIC16: tl.constexpr, magic):
    """The tile of [BN, KW] packed words dequantized as [BN, KW, 4, 2]: pair c of word w (inputs 8w + 2c and
    8w + 2c + 1) on axis 2, its two inputs on axis 3 -- flat, 8w + 2c + h, the inputs' own order. The pair index is
    a tensor axis, not four tensors joined, so the compiler lays the words out as the MMA's register operand wants
    them (a thread holds every word of its two rows, its lane picks the pair) and extracts only its own pairs: no
    layout conversion through shared memory. zb, s: [BN, 1] as `_plane` takes them; (q - z) * s rounded to dtype
    either way (16-bit: (OFFSET + q) - (OFFSET + z), exact, times s). magic: MAGIC16 in both halves of an int32,
    as a value the compiler cannot fold (a register: the mask then is the LOP3's one immediate)."""
    if MAGIC16:
        # byte c of each word alone (one PRMT: selector 0x4440 + c takes byte c, then zero bytes); times 0x1001
        # it is b | b << 12, so its nibble 2c sits at bits 0..3 and 2c + 1 at bits 16..19; masked, each half
        # or-ed into OFFSET's bits (one LOP3, `magic` in a register): one register read as its two 16-bit
        # halves (inline PTX: a register split, no instruction), OFFSET + q each. Three instructions a pair,
        # against five for a shift, a shift left and three masks or ors
        shape: tl.constexpr = (packed.shape[0], packed.shape[1], 4)
        sel = tl.broadcast_to((0x4440 + tl.arange(0, 4))[None, None, :], shape)
        b = tl.inline_asm_elementwise("prmt.b32 $0, $1, 0, $2;", "=r,r,r",
                                      [tl.broadcast_to(packed[:, :, None], shape), sel],
                                      dtype=tl.int32, is_pure=True, pack=1)  # [BN, KW, 4]: byte c at bits 0..7
        t = ((b * 0x1001) & 0x000F000F) | magic
        if MAGIC16 == 0x4300:  # bf16's 128.0
            even, odd = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [t],
                                                  dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
        else:  # fp16's 1024.0
            even, odd = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [t],
                                                  dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
        return (tl.join(even, odd) - zb[:, :, None, None]) * s[:, :, None, None]  # the same numbers
    p = packed[:, :, None] >> (8 * tl.arange(0, 4))[None, None, :]  # [BN, KW, 4]: pair c at bits 0..7
    even = dequant_plane(p, 0, zb[:, :, None], s[:, :, None]).to(dtype, fp_downcast_rounding="rtne")
    odd = dequant_plane(p, 1, zb[:, :, None], s[:, :, None]).to(dtype, fp_downcast_rounding="rtne")
    return tl.join(even, odd)


@triton.jit(do_not_specialize=["M"])  # the step's token count: no variant per divisibility, so eager steps of
# any count run what the warm-up's and the graphs' sizes compiled
def _int4_mma_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr,
    M, N, K, K_PER_SPLIT,  # split s (program_id 2) covers inputs [s * K_PER_SPLIT, (s + 1) * K_PER_SPLIT)
    stride_xm, stride_xk, stride_qk, stride_sg, stride_ys, stride_ym, stride_yn,
    GROUP: tl.constexpr,  # inputs a scale group: a multiple of BLOCK_K (or K itself)
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,  # the CPU interpreter: its 16-bit dot multiplies the operands' bit patterns; the same
    # (16-bit-rounded) values in float32 give the products the MMA makes
    MAGIC16: tl.constexpr = 0,  # bits of OFFSET in x's dtype (bf16 0x4300 = 128.0, fp16 0x6400 = 1024.0): the
    # dequantize in 16-bit math; 0: in float32
    OFFSET: tl.constexpr = 0.0,
    PDL: tl.constexpr = False,
    PAIRS: tl.constexpr = False,  # the tile as [BN, KW, 4, 2] (_pairs): no layout conversion; with MAGIC16 a
    # pair of neighbouring inputs one register
):
    pdl_enter(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] weight rows (outputs)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] tokens
    mask_n = offs_n < N
    mask_m = offs_m < M
    offs_w = tl.arange(0, BLOCK_K // 8)  # [KW] word rows of a tile
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start, k_end = split_range(tl.program_id(2), K, K_PER_SPLIT)
    # both halves' OFFSET bits, not foldable (K_PER_SPLIT > 0, so the shift is 0): with two immediates ptxas
    # spends a second LOP3 a pair on masking and or-ing (sm_90 SASS)
    magic = MAGIC16 * 0x10001 + (K_PER_SPLIT >> 31)
    for k0 in range(k_start, k_end, BLOCK_K):  # K and K_PER_SPLIT are multiples of BLOCK_K (the launcher checks)
        words = k0 // 8 + offs_w
        packed = tl.load(qw_ptr + words[None, :] * stride_qk + offs_n[:, None], mask=mask_n[:, None],
                         other=0)  # [BN, KW] int32, N contiguous in memory
        sz = (k0 // GROUP) * stride_sg + offs_n
        dt = x_ptr.dtype.element_ty
        if MAGIC16:  # OFFSET + z in x's dtype, exact for integer zeros (GPTQ / AWQ); s as stored
            s = tl.load(s_ptr + sz, mask=mask_n, other=0.0).to(dt)[:, None]  # [BN, 1]
            zb = (tl.load(z_ptr + sz, mask=mask_n, other=0.0).to(tl.float32) + OFFSET).to(dt)[:, None]
        else:
            s = tl.load(s_ptr + sz, mask=mask_n, other=0.0).to(tl.float32)[:, None]  # [BN, 1]
            zb = tl.load(z_ptr + sz, mask=mask_n, other=0.0).to(tl.float32)[:, None] + _TWO_23  # 2^23 + z, exact
        # one [BN, BLOCK_K] operand and one dot a tile: MMAs with a register operand each wait for completion
        # (wgmma.wait_group 0) in this compiler, so not one dot a plane or pair
        if PAIRS:
            w = _pairs(packed, zb, s, dt, MAGIC16, magic)  # [BN, KW, 4, 2]
        else:
            # the eight planes joined: join appends its axis last, the innermost pairs planes j, j + 4, the
            # outermost j, j + 1, so the reshape puts plane j of word w at column 8w + j -- the inputs' own order
            w = tl.join(tl.join(tl.join(_plane(packed, 0, zb, s, dt, MAGIC16), _plane(packed, 4, zb, s, dt, MAGIC16)),
                                tl.join(_plane(packed, 2, zb, s, dt, MAGIC16), _plane(packed, 6, zb, s, dt, MAGIC16))),
                        tl.join(tl.join(_plane(packed, 1, zb, s, dt, MAGIC16), _plane(packed, 5, zb, s, dt, MAGIC16)),
                                tl.join(_plane(packed, 3, zb, s, dt, MAGIC16), _plane(packed, 7, zb, s, dt, MAGIC16))))  # [BN, KW, 2, 2, 2]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))  # [BN, BK]
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None] * stride_xk, mask=mask_m[None, :],
                     other=0.0)  # [BK, BM]
        if DOT_F32:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
    y_ptr += tl.program_id(2) * stride_ys  # one split: y itself; more: this split's float32 partials
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[None, :] & mask_n[:, None])


def int4_mma_gemm(
    x: torch.Tensor,  # [M, K] bf16 / fp16
    qweight: torch.Tensor,  # int32 [K / 8, N], N contiguous
    scales: torch.Tensor,  # [groups, N]
    zeros: torch.Tensor,  # [groups, N], same dtype and strides as scales; integer values (GPTQ / AWQ)
    group_size: int,  # inputs a scale group, in order (int4_linear.tileable_group); K: one group
    out: torch.Tensor | None = None,  # [M, N] in x's dtype, written in full
    tile: MmaTile = DEFAULT_TILE,
    magic16: bool = True,  # dequantize in 16-bit math (the same numbers); False: in float32 (benchmarks compare)
) -> torch.Tensor:  # [M, N] in x's dtype
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * 8 != k or scales.shape != zeros.shape or scales.shape[1] != n:
        raise ValueError(f"int4_mma_gemm: shapes do not fit: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, "
                         f"scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)}")
    if qweight.stride(1) != 1 or scales.stride(1) != 1 or zeros.stride() != scales.stride():
        raise ValueError("int4_mma_gemm: qweight, scales and zeros need contiguous rows and equal strides")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"int4_mma_gemm: x must be bf16 or fp16, got {x.dtype}")
    why = misfit(k, group_size, tile)
    if why:
        raise ValueError(f"int4_mma_gemm: {why}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return y
    dst = SplitKOutput(y, k, tile.block_k, tile.split_k)  # K_PER_SPLIT a multiple of BLOCK_K: whole groups
    grid = (triton.cdiv(n, tile.block_n), triton.cdiv(m, tile.block_m), dst.splits)
    _int4_mma_kernel[grid](x, qweight, scales, zeros, dst.buf, m, n, k, dst.k_per_split, x.stride(0), x.stride(1),
                           qweight.stride(0), scales.stride(0), *dst.strides, GROUP=min(group_size, k),
                           BLOCK_N=tile.block_n, BLOCK_M=tile.block_m, BLOCK_K=tile.block_k,
                           DOT_F32=x.device.type == "cpu",
                           # the interpreter's 16-bit bitcasts and arithmetic are not the GPU's: float32 there
                           # int4_triton's table: x's dtype -> (bits, value) of OFFSET, whose mantissa's
                           # last 4 bits take a nibble exactly
                           MAGIC16=_MAGIC[x.dtype][0] if magic16 and x.device.type != "cpu" else 0,
                           PAIRS=tile.pairs,
                           OFFSET=_MAGIC[x.dtype][1],
                           num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_kwargs(x))
    return dst.finish()
