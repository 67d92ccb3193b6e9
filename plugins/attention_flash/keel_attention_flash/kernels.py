"""Triton kernels of triton_flash: cache write (optionally with the rope), varlen paged attention, split-K decode
and its reduce.

The KV cache is the standard layout [2, num_blocks, block_size, num_kv_heads, head_size], addressed
here as slots: slot = block_id * block_size + offset. Key tiles gather their slots through the block
table, so a tile may span several pages and the tile width does not depend on the block size.

Query heads of one KV head are packed into the rows of one tile (row = query token * G_PAD + head in
group), so GQA/MQA read every K/V tile once per KV head and `tl.dot` always sees >= 16 rows.

Split-K decode also serves uniform steps where every request has the same few new tokens (speculative
verification: 1 + drafts), causal among themselves: its launch grid depends only on the batch size, the
query length and the split count, so such steps can be captured as CUDA graphs.

Softmax runs in float32 in the log2 domain. The running max starts at a large finite negative value
(not -inf) so that fully masked rows never compute inf - inf; masked K/V loads read 0 because cache
slots outside a request's context may hold anything (NaN in the conformance suite).

An fp8 (e4m3) cache is written quantized by the write kernel itself (`e4m3.quantize_e4m3_bits`: the bytes of
torch's `quantize_kv`) and read as raw e4m3 tiles, the layer's scales folded into the score scale (k_scale)
and the output (v_scale). With a bf16 q the tiles become fp16, not bf16 (`_q_operand`): sm_90 turns two e4m3
into two fp16 in one instruction, while bf16 took one more conversion per element at quarter rate (the decode
loop's SASS with the device's Triton 3.6, `benchmarks/sass_mix.py --attention`: 914 instructions a thread, 701 in
fp16, 423 over a bf16 cache). Every e4m3 value is exact in fp16.
fp8 decode still reads its half-size cache at ~57% of copy bandwidth where bf16 reads at ~94% (H100;
docs/architecture.md says what was tried).
"""

from __future__ import annotations

import triton
import triton.language as tl

from keel_attention_flash.e4m3 import quantize_e4m3_bits
from keel_attention_flash.pdl import pdl_enter

# Whether this module's kernels were jitted for the interpreter (triton.jit decides as it decorates them)
_INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret)
_NEG_BIG = tl.constexpr(-1.0e30)
LOG2E = 1.4426950408889634


@triton.jit
def _store_kv(dst, x, mask, scale_ptr, FP8_KV: tl.constexpr):
    """K or V values into their cache slots: fp8, quantize_kv's bytes computed here (in torch it took ~4 kernels
    a tensor before the copy); else cast to the cache's dtype."""
    if FP8_KV:
        tl.store(dst, quantize_e4m3_bits(x.to(tl.float32), tl.load(scale_ptr)), mask=mask)
    else:
        tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def reshape_and_cache_kernel(
    k_ptr, v_ptr,  # [num_tokens, num_kv_heads, head_size], last dim contiguous
    cache_ptr,  # [2, num_slots, num_kv_heads, head_size] contiguous; FP8_KV: a uint8 view of the e4m3 cache
    slot_ptr,  # [num_tokens] int64, -1 = skip
    stride_kt, stride_kh, stride_vt, stride_vh,
    cache_kv_stride,  # elements between the K and the V half of the cache
    k_scale_ptr, v_scale_ptr,  # float32 [1] each (read when FP8_KV): stored = x / scale
    NUM_KV_HEADS: tl.constexpr, HEAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8_KV: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    slots = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot
    mask = (h < NUM_KV_HEADS) & (d < HEAD) & (slots >= 0)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = cache_ptr + slots * (NUM_KV_HEADS * HEAD) + h * HEAD + d
    _store_kv(dst, k, mask, k_scale_ptr, FP8_KV)
    _store_kv(dst + cache_kv_stride, v, mask, v_scale_ptr, FP8_KV)


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
def _rope_halves(x_row, stride_h, h, dd, mask, cos, sin, dt: tl.constexpr, HALF: tl.constexpr):
    """One block of heads' rotated halves ([BLOCK_H, BLOCK_HALF] each, in `dt`) as torch rotates them:
    x * cos + cat(-x2, x1) * sin, each product and the sum rounded to `dt`, cos / sin already in `dt`."""
    x1 = tl.load(x_row + h * stride_h + dd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + h * stride_h + HALF + dd, mask=mask, other=0.0).to(tl.float32)
    a1 = _round_to(x1 * cos, dt).to(tl.float32)
    b1 = _round_to(x2 * sin, dt).to(tl.float32)
    a2 = _round_to(x2 * cos, dt).to(tl.float32)
    b2 = _round_to(x1 * sin, dt).to(tl.float32)
    return _round_to(a1 - b1, dt), _round_to(a2 + b2, dt)


@triton.jit
def rope_and_cache_kernel(
    pos_ptr,  # [num_tokens] int
    q_ptr,  # [num_tokens, num_heads, HEAD] at (stride_qt, stride_qh), last dim contiguous
    q_out_ptr,  # [num_tokens, num_heads, HEAD] contiguous: q rotated
    k_ptr, v_ptr,  # [num_tokens, num_kv_heads, HEAD], last dim contiguous (k read unrotated)
    cache_ptr,  # [2, num_slots, num_kv_heads, HEAD] contiguous; FP8_KV: a uint8 view of the e4m3 cache
    slot_ptr,  # [>= num_write] int64, -1 = skip
    cos_ptr, sin_ptr,  # [cache_len, ROT] float32 contiguous (the two halves are equal)
    num_write,  # rows whose K/V are written (the rest: padding)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    cache_kv_stride,
    k_scale_ptr, v_scale_ptr,  # float32 [1] each (read when FP8_KV)
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD: tl.constexpr, ROT: tl.constexpr,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_KVH: tl.constexpr,  # key / value heads in a tile of program (t, 1); BLOCK_H: query heads, of (t, 0)
    FP8_KV: tl.constexpr, PDL: tl.constexpr = False,
):
    """Neox rope and the cache write in one launch: program (t, 0) writes token t's rotated query heads to
    q_out, (t, 1) rotates its key heads in registers and writes them and the values into the token's slot. The
    rotation is the rope op's (kernels-triton's `rotary_embedding`, torch's rounding), the write
    `reshape_and_cache_kernel`'s; the key tensor itself stays unrotated (the attention reads the cache)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    dt = q_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dd = tl.arange(0, BLOCK_HALF)[None, :]
    cos = _round_to(tl.load(cos_ptr + pos * ROT + dd, mask=dd < HALF, other=0.0), dt).to(tl.float32)
    sin = _round_to(tl.load(sin_ptr + pos * ROT + dd, mask=dd < HALF, other=0.0), dt).to(tl.float32)
    hh = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    if tl.program_id(1) == 0:
        q_row = q_ptr + t * stride_qt
        o_row = q_out_ptr + t * (NUM_HEADS * HEAD)
        for h0 in range(0, NUM_HEADS, BLOCK_H):
            h = h0 + hh
            mask = (h < NUM_HEADS) & (dd < HALF)
            o1, o2 = _rope_halves(q_row, stride_qh, h, dd, mask, cos, sin, dt, HALF)
            tl.store(o_row + h * HEAD + dd, o1, mask=mask)
            tl.store(o_row + h * HEAD + HALF + dd, o2, mask=mask)
            if ROT < HEAD:  # partial rotary: the tail of each head passes through
                tail = (h < NUM_HEADS) & (d >= ROT) & (d < HEAD)
                tl.store(o_row + h * HEAD + d, tl.load(q_row + h * stride_qh + d, mask=tail), mask=tail)
    else:
        # The keys and values are loaded before anything waits on the slot, and the values before the keys'
        # stores: every load is in flight at once. (Behind `if slot >= 0`, and the value load in program order
        # after the keys' stores, each added a memory latency to a batch-1 step's critical path.) A padding row's
        # loads are real rows of k and v; only its stores are masked off.
        # Its own head tile: sized for the query heads, the masked rows of a GQA model's few key heads each
        # still ran the fp8 quantization (Llama-8B, 1024 tokens: 42 us a layer on an H100, ~6x its bytes)
        hk = tl.arange(0, BLOCK_KVH)[:, None]
        slot = tl.load(slot_ptr + t, mask=t < num_write, other=-1).to(tl.int64)
        write = (hk * 0 + slot) >= 0  # [BLOCK_KVH, 1]: a block, as the store masks it joins are
        k_row = k_ptr + t * stride_kt
        dst = cache_ptr + tl.maximum(slot, 0) * (NUM_KV_HEADS * HEAD)
        for h0 in range(0, NUM_KV_HEADS, BLOCK_KVH):
            h = h0 + hk
            vmask = (h < NUM_KV_HEADS) & (d < HEAD)
            vals = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=vmask)
            mask = (h < NUM_KV_HEADS) & (dd < HALF)
            o1, o2 = _rope_halves(k_row, stride_kh, h, dd, mask, cos, sin, dt, HALF)
            if ROT < HEAD:  # partial rotary: the tail of each key head passes through
                tail = (h < NUM_KV_HEADS) & (d >= ROT) & (d < HEAD)
                _store_kv(dst + h * HEAD + d, tl.load(k_row + h * stride_kh + d, mask=tail), tail & write,
                          k_scale_ptr, FP8_KV)
            _store_kv(dst + h * HEAD + dd, o1, mask & write, k_scale_ptr, FP8_KV)
            _store_kv(dst + h * HEAD + HALF + dd, o2, mask & write, k_scale_ptr, FP8_KV)
            _store_kv(dst + cache_kv_stride + h * HEAD + d, vals, vmask & write, v_scale_ptr, FP8_KV)


@triton.jit
def _e4m3_byte(words, i: tl.constexpr):
    """Byte i (0 = lowest address) of each little-endian word, as fp16 (the interpreter's path)."""
    return ((words >> (8 * i)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _e4m3_words_to_f16(words, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """[BLOCK_N, BLOCK_D / 4] int32 words of packed e4m3 -> [BLOCK_N, BLOCK_D] fp16 (exact), converted in the
    registers the words were loaded into: loaded as e4m3, Triton converted after its shared-memory layout change
    and read the dot operands a byte at a time (64 LDS.U8 a thread per 32-token tile in sm_90 SASS)."""
    if _INTERPRETED:  # no inline PTX: the same bytes, unpacked one by one
        e0, e1, e2, e3 = _e4m3_byte(words, 0), _e4m3_byte(words, 1), _e4m3_byte(words, 2), _e4m3_byte(words, 3)
    else:  # cvt.rn.f16x2.e4m3x2: a 16-bit pair's low byte into the low half, two elements an instruction
        e0, e1, e2, e3 = tl.inline_asm_elementwise(
            "{ .reg .b32 a, b; .reg .b16 lo, hi; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
            "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
            "=h,=h,=h,=h,r", [words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    # join adds a minor axis: [.., x, y] = (e0, e2)[x] if y == 0 else (e1, e3)[x], so x * 2 + y is address order
    return tl.reshape(tl.join(tl.join(e0, e2), tl.join(e1, e3)), (BLOCK_N, BLOCK_D))


@triton.jit
def _pow2_at_or_below(top):
    """float32 [rows] >= 0 -> the power of two at or below each (its exponent bits alone); 1 for zero or a float32
    subnormal. inf / NaN give inf: a row holding them stays garbage, as it is anyway."""
    p2 = (top.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(p2 > 0.0, p2, 1.0)


@triton.jit
def _q_operand(q, sm_scale_log2, FP8_KV: tl.constexpr):
    """(q as the score dot's operand, score scale). An fp8 cache: the scale per row, [rows]; with a bf16 q, q goes
    fp16 divided per row by the power of two at or below its largest |element| (exact), so no bf16 value
    overflows fp16 and each keeps its 8 significant bits, and the row's scale takes the power back.
    Otherwise (q, the scalar scale)."""
    op = q
    scale = sm_scale_log2
    if FP8_KV:
        p2 = tl.full([q.shape[0]], 1.0, tl.float32)  # [rows]
        if q.dtype == tl.bfloat16:
            qf = q.to(tl.float32)
            p2 = _pow2_at_or_below(tl.max(tl.abs(qf), 1))
            op = (qf / p2[:, None]).to(tl.float16)
        scale = sm_scale_log2 * p2
    return op, scale


@triton.jit
def _fp8_scales(sm_scale_log2, k_scale_ptr, v_scale_ptr, FP8_KV: tl.constexpr):
    """(score scale, output scale). An fp8 cache's scales are folded out of the tiles: scores are
    q . stored_k * k_scale and the output is (p @ stored_v) * v_scale, so no tile is ever multiplied."""
    if FP8_KV:
        return sm_scale_log2 * tl.load(k_scale_ptr), tl.load(v_scale_ptr)
    return sm_scale_log2, 1.0


@triton.jit
def _tile_blocks(bt_row_ptr, n_start, seq_len, key_lo, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """The cache block of each key position in the tile at n_start, [BLOCK_N] int64 (0 outside [key_lo, seq_len))."""
    pos = n_start + tl.arange(0, BLOCK_N)
    in_ctx = (pos < seq_len) & (pos >= key_lo)
    return tl.load(bt_row_ptr + pos // PAGE, mask=in_ctx, other=0).to(tl.int64)


@triton.jit
def _kv_words(cache_ptr, cache_kv_stride, block, kv_head, n_start, seq_len, key_lo,
              NUM_KV_HEADS: tl.constexpr, HEAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
              PAGE: tl.constexpr):
    """One key tile's K and V of an e4m3 cache as int32 words, [BLOCK_N, BLOCK_D // 4] each (HEAD % 4 == 0),
    zeros outside [key_lo, seq_len), from its blocks (`_tile_blocks`): loaded into registers, converted only when
    the tile is attended."""
    pos = n_start + tl.arange(0, BLOCK_N)
    in_ctx = (pos < seq_len) & (pos >= key_lo)
    slot = block * PAGE + pos % PAGE
    dw = tl.arange(0, BLOCK_D // 4)
    w_off = slot[:, None] * (NUM_KV_HEADS * HEAD // 4) + kv_head * (HEAD // 4) + dw[None, :]
    w_mask = in_ctx[:, None] & (dw[None, :] < HEAD // 4)
    words_ptr = cache_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    return (tl.load(words_ptr + w_off, mask=w_mask, other=0),
            tl.load(words_ptr + cache_kv_stride // 4 + w_off, mask=w_mask, other=0))


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, cache_ptr, cache_kv_stride, bt_row_ptr, kv_head, n_start, seq_len,
    q_pos,  # [BLOCK_M] int32 position of each row's query token
    key_lo,  # lowest key position any row may see (sliding window), else 0
    sm_scale_log2,  # FP8_KV: [BLOCK_M], times k_scale (see _fp8_scales, _q_operand)
    NUM_KV_HEADS: tl.constexpr, HEAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    FP8_KV: tl.constexpr,
    FP8_WORDS: tl.constexpr = False,  # FP8_KV as int32 words (_kv_words, _e4m3_words_to_f16); q an fp16 operand
    k_words=None, v_words=None,  # FP8_WORDS: this tile's words if the caller loaded them ahead, else loaded here
    blocks=None,  # this tile's cache blocks (_tile_blocks) if the caller loaded them ahead, else loaded here
):
    pos = n_start + tl.arange(0, BLOCK_N)
    in_ctx = (pos < seq_len) & (pos >= key_lo)
    d = tl.arange(0, BLOCK_D)
    if blocks is None:
        blocks = _tile_blocks(bt_row_ptr, n_start, seq_len, key_lo, BLOCK_N, PAGE)
    if FP8_WORDS:  # fp16 tiles for an fp16 q operand
        if k_words is None:
            k_words, v_words = _kv_words(cache_ptr, cache_kv_stride, blocks, kv_head, n_start, seq_len, key_lo,
                                         NUM_KV_HEADS, HEAD, BLOCK_D, BLOCK_N, PAGE)
        k = _e4m3_words_to_f16(k_words, BLOCK_N, BLOCK_D)
    else:
        slot = blocks * PAGE + pos % PAGE
        kv_off = slot[:, None] * (NUM_KV_HEADS * HEAD) + kv_head * HEAD + d[None, :]
        kv_mask = in_ctx[:, None] & (d[None, :] < HEAD)
        k = tl.load(cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if FP8_KV:  # the stored e4m3 value, exact in q's dtype (fp16 for bf16 models); its scale is in sm_scale_log2
            k = k.to(q.dtype)
    if DOT_F32:  # Triton's interpreter mis-multiplies 16-bit dot operands: give it float32
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if FP8_KV:  # a scale per row (_q_operand)
        s = s * sm_scale_log2[:, None]  # [BLOCK_M, BLOCK_N]
    else:
        s = s * sm_scale_log2  # [BLOCK_M, BLOCK_N]
    visible = in_ctx[None, :] & (pos[None, :] <= q_pos[:, None])
    if WINDOW > 0:
        visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8_WORDS:
        v = _e4m3_words_to_f16(v_words, BLOCK_N, BLOCK_D)
    else:
        v = tl.load(cache_ptr + cache_kv_stride + kv_off, mask=kv_mask, other=0.0)
        if FP8_KV:  # likewise; v_scale multiplies the output once
            v = v.to(q.dtype)
    p = p.to(v.dtype)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def varlen_paged_attention_kernel(
    q_ptr, out_ptr, cache_ptr, cache_kv_stride,
    tile_req_ptr, tile_q0_ptr,  # [num_tiles] int32: request of each query tile, first query row in it
    query_start_ptr, seq_lens_ptr, block_table_ptr, stride_bt,
    stride_qt, stride_qh, stride_ot, stride_oh,
    sm_scale_log2,
    k_scale_ptr, v_scale_ptr,  # float32 [1] each (read when FP8_KV)
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    WINDOW: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, FP8_KV: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program: BLOCK_Q query tokens of one request x the GROUP query heads of one KV head."""
    pdl_enter(PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    r = tl.arange(0, BLOCK_M)
    q_tok = q0 + r // G_PAD
    head = kv_head * GROUP + r % G_PAD
    row_ok = (q_tok < q_len) & (r % G_PAD < GROUP)
    q_pos = ctx_len + q_tok
    d = tl.arange(0, BLOCK_D)
    tok = (q_start + q_tok).to(tl.int64)
    q_mask = row_ok[:, None] & (d[None, :] < HEAD)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=q_mask,
                other=0.0)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    qk_scale, v_scale = _fp8_scales(sm_scale_log2, k_scale_ptr, v_scale_ptr, FP8_KV)
    q, qk_scale = _q_operand(q, qk_scale, FP8_KV)
    # Keys this tile can see: up to its last query's position, from the window of its first query.
    hi = tl.minimum(seq_len, ctx_len + q0 + BLOCK_Q)
    key_lo = 0
    if WINDOW > 0:
        key_lo = tl.maximum(ctx_len + q0 - WINDOW + 1, 0)
    lo = (key_lo // BLOCK_N) * BLOCK_N
    for n_start in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, cache_ptr, cache_kv_stride, bt_row, kv_head, n_start, seq_len, q_pos, key_lo,
            qk_scale, NUM_KV_HEADS, HEAD, BLOCK_D, BLOCK_N, PAGE, WINDOW, PRECISION, DOT_F32, FP8_KV,
        )
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None] * v_scale
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def split_decode_kernel(
    q_ptr, cache_ptr, cache_kv_stride,
    part_out_ptr,  # [num_reqs * QUERY_LEN, NUM_SPLITS, num_heads, HEAD] float32, normalized per split
    part_lse_ptr,  # [num_reqs * QUERY_LEN, NUM_SPLITS, num_heads] float32, log2-sum-exp2 (-inf: empty split)
    out_ptr, stride_ot, stride_oh,  # DIRECT: the attention output [num_tokens, num_heads, HEAD]
    query_start_ptr, seq_lens_ptr, block_table_ptr, stride_bt,
    stride_qt, stride_qh,
    sm_scale_log2,
    k_scale_ptr, v_scale_ptr,  # float32 [1] each (read when FP8_KV)
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HEAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    WINDOW: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    QUERY_LEN: tl.constexpr, Q_PAD: tl.constexpr, DIRECT: tl.constexpr, FP8_KV: tl.constexpr,
    FP8_WORDS: tl.constexpr = False, PDL: tl.constexpr = False,
    WORDS_AHEAD: tl.constexpr = True,  # FP8_WORDS: the next tile's words loaded before this one is attended
    BLOCKS_AHEAD: tl.constexpr = False,  # not WORDS_AHEAD: the next tile's block numbers loaded before this one
):
    """Flash-decoding: one program = one request x one KV head x one slice of the context.

    Every request has exactly QUERY_LEN new tokens (1: decode; more: a uniform speculative verify step),
    causal among themselves; rows = query token * G_PAD + head in group, Q_PAD = next power of two.
    DIRECT (one split): the program writes the final output itself and the part buffers are unused -- no
    float32 round trip and no reduce launch, which at big batches of short contexts cost as much as the
    keys and values.
    """
    pdl_enter(PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    q_start = tl.load(query_start_ptr + req).to(tl.int64)
    ctx_len = seq_len - QUERY_LEN

    r = tl.arange(0, Q_PAD * G_PAD)
    j = r // G_PAD
    g = r % G_PAD
    head = kv_head * GROUP + g
    row_ok = (j < QUERY_LEN) & (g < GROUP)
    d = tl.arange(0, BLOCK_D)
    q_mask = row_ok[:, None] & (d[None, :] < HEAD)
    tok = q_start + j
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=q_mask,
                other=0.0)

    key_lo = 0
    if WINDOW > 0:  # the first query token's window; later rows mask their own in _attend_tile
        key_lo = tl.maximum(ctx_len - WINDOW + 1, 0)
    span = seq_len - key_lo
    # Whole tiles per split, so splits never share a tile.
    per_split = tl.cdiv(tl.cdiv(span, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = key_lo + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    acc = tl.zeros([Q_PAD * G_PAD, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([Q_PAD * G_PAD], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([Q_PAD * G_PAD], dtype=tl.float32)
    q_pos_rows = ctx_len + j
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    qk_scale, v_scale = _fp8_scales(sm_scale_log2, k_scale_ptr, v_scale_ptr, FP8_KV)
    q, qk_scale = _q_operand(q, qk_scale, FP8_KV)
    if FP8_WORDS and WORDS_AHEAD:
        # Software-pipelined by hand, in registers: the next tile's words are loaded before this tile is attended,
        # from block numbers loaded an iteration earlier still, so no load waits on another inside an iteration.
        # The compiler's pipelining staged the words through shared memory, waited for every copy at the top of the
        # loop and sent the next tile's only after its page index's load, late in the body (sm_90 SASS, Triton
        # 3.6). Prefetches past the context are masked off.
        k_words, v_words = _kv_words(cache_ptr, cache_kv_stride, _tile_blocks(bt_row, lo, hi, key_lo, BLOCK_N, PAGE),
                                     kv_head, lo, hi, key_lo, NUM_KV_HEADS, HEAD, BLOCK_D, BLOCK_N, PAGE)
        blocks_next = _tile_blocks(bt_row, lo + BLOCK_N, hi, key_lo, BLOCK_N, PAGE)
        for n_start in range(lo, hi, BLOCK_N):
            blocks_after = _tile_blocks(bt_row, n_start + 2 * BLOCK_N, hi, key_lo, BLOCK_N, PAGE)
            k_next, v_next = _kv_words(cache_ptr, cache_kv_stride, blocks_next, kv_head, n_start + BLOCK_N, hi,
                                       key_lo, NUM_KV_HEADS, HEAD, BLOCK_D, BLOCK_N, PAGE)
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, cache_ptr, cache_kv_stride, bt_row, kv_head, n_start, hi, q_pos_rows, key_lo,
                qk_scale, NUM_KV_HEADS, HEAD, BLOCK_D, BLOCK_N, PAGE, WINDOW, PRECISION, DOT_F32, FP8_KV, True,
                k_words, v_words,
            )
            k_words, v_words, blocks_next = k_next, v_next, blocks_after
    else:
        # A bf16 cache, fp8 bytes, or words loaded where each tile is attended: no next tile held in registers
        # (words: sm_90 SASS, Triton 3.6, a 32-token tile at 2 warps, 523 instructions and 144 registers a thread,
        # against 621 and 186 ahead)
        # BLOCKS_AHEAD: the block numbers a tile's loads address come from the iteration before (a loop-carried
        # value), not from a load in the same iteration, so the pipeliner can issue its key / value copies more
        # than a tile ahead (num_stages >= 3; impl._BLOCKS_AHEAD has the sm_90 SASS).
        blocks = None
        if BLOCKS_AHEAD:
            blocks = _tile_blocks(bt_row, lo, hi, key_lo, BLOCK_N, PAGE)
        for n_start in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, cache_ptr, cache_kv_stride, bt_row, kv_head, n_start, hi, q_pos_rows, key_lo,
                qk_scale, NUM_KV_HEADS, HEAD, BLOCK_D, BLOCK_N, PAGE, WINDOW, PRECISION, DOT_F32, FP8_KV, FP8_WORDS,
                blocks=blocks,
            )
            if BLOCKS_AHEAD:  # the next tile's (masked off past the slice)
                blocks = _tile_blocks(bt_row, n_start + BLOCK_N, hi, key_lo, BLOCK_N, PAGE)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None] * v_scale  # per split: the reduce is linear in it
    if DIRECT:  # an empty context gives 0, as the reduce does
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        num_heads = NUM_KV_HEADS * GROUP
        base = ((req.to(tl.int64) * QUERY_LEN + j) * NUM_SPLITS + split) * num_heads + head
        # An empty split (a context shorter than the split capacity the launch was sized for) writes
        # only its -inf lse; the reduce never reads its partial.
        tl.store(part_out_ptr + base[:, None] * HEAD + d[None, :], out, mask=q_mask & ~empty[:, None])
        tl.store(part_lse_ptr + base, lse, mask=row_ok)


@triton.jit
def split_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD: tl.constexpr, BLOCK_D: tl.constexpr, QUERY_LEN: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Combine the splits of one query token x one query head (log-sum-exp weights); 0 for an empty
    context. Program 0 runs over requests x QUERY_LEN tokens each."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    req = row // QUERY_LEN
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    base = (row.to(tl.int64) * NUM_SPLITS + s) * NUM_HEADS + head
    lse = tl.load(part_lse_ptr + base, mask=s < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)
    o = tl.load(part_out_ptr + base[:, None] * HEAD + d[None, :],
                mask=(s[:, None] < NUM_SPLITS) & (lse[:, None] > float("-inf")) & (d[None, :] < HEAD), other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tok = tl.load(query_start_ptr + req).to(tl.int64) + row % QUERY_LEN
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD)
