"""Triton kernels of triton_mla: latent cache write, paged latent attention (split-K), split reduce.

The cache is [num_blocks, block_size, L + R]: one latent cat(kv_c, k_pe) per token slot, addressed
through the block table (slot = block * PAGE + offset), never expanded to per-head K/V.

Attention runs in the absorbed form for every query row: the query arrives already folded through
W_UK (q_c: [T, H, L]) next to its rope part (q_pe: [T, H, R]); each cached latent is one key/value
head shared by all H query heads, score = q_c . kv_c + q_pe . k_pe, and the value is kv_c itself, so
one latent tile is loaded once and feeds both dot products. The output stays in latent space
([T, H, L]); W_UV is applied by the caller.

Rows of a tile are (query token, head) pairs, row = token * BLOCK_H + head in block, so decode tiles
(one token) pack BLOCK_H heads and `tl.dot` always sees >= 16 rows. The latent is split in its kv_c
and k_pe parts (BLOCK_L, BLOCK_R) so neither is padded to the next power of two of L + R.

Split-K decode tiles also serve uniform steps where every request has the same few new tokens
(speculative verification, 1 + drafts): BLOCK_Q rows per request, causal among themselves, as
FlashMLA does for speculative decoding. Their grid depends only on the batch size, the query length and
the split count, so such steps can be captured as CUDA graphs.

Softmax runs in float32 in the log2 domain, the running max starting at a large finite negative
value so fully masked rows never compute inf - inf; masked latent loads read 0 because slots outside
a request's context (and the null block) may hold anything, NaN included.

An fp8 (e4m3) latent cache is written quantized by the write kernel (`e4m3.quantize_e4m3_bits`: the bytes of
torch's `quantize_kv`) and read as raw e4m3 tiles in q's dtype, k_scale folded into the score scale and
the output.
"""

from __future__ import annotations

import triton
import triton.language as tl

from keel_attention_flash.e4m3 import quantize_e4m3_bits
from keel_attention_flash.kernels import _e4m3_words_to_f16, _pow2_at_or_below, _tile_blocks
from keel_attention_flash.pdl import pdl_enter

_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def mla_write_latent_kernel(
    kv_c_ptr,  # [num_tokens, L], last dim contiguous
    k_pe_ptr,  # [num_tokens, R], last dim contiguous
    cache_ptr,  # [num_blocks, block_size, L + R], last dim contiguous; FP8_KV: a uint8 view of the e4m3 cache
    slot_ptr,  # [num_tokens] int64, -1 = skip
    stride_ct, stride_pt, stride_cb, stride_cs,
    k_scale_ptr,  # float32 [1] (read when FP8_KV): stored = latent / k_scale, both parts
    PAGE: tl.constexpr, LORA: tl.constexpr, BLOCK_L: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr, FP8_KV: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program per new token: cat(kv_c, k_pe) into its slot (FP8_KV: quantize_kv's bytes of each)."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    dst = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
    dl = tl.arange(0, BLOCK_L)
    lmask = (dl < LORA) & ((tl.zeros([BLOCK_L], dtype=tl.int64) + slot) >= 0)
    c = tl.load(kv_c_ptr + t.to(tl.int64) * stride_ct + dl, mask=lmask)
    dr = tl.arange(0, BLOCK_R)
    rmask = (dr < ROPE) & ((tl.zeros([BLOCK_R], dtype=tl.int64) + slot) >= 0)
    pe = tl.load(k_pe_ptr + t.to(tl.int64) * stride_pt + dr, mask=rmask)
    if FP8_KV:
        scale = tl.load(k_scale_ptr)
        tl.store(dst + dl, quantize_e4m3_bits(c.to(tl.float32), scale), mask=lmask)
        tl.store(dst + LORA + dr, quantize_e4m3_bits(pe.to(tl.float32), scale), mask=rmask)
    else:
        tl.store(dst + dl, c.to(cache_ptr.dtype.element_ty), mask=lmask)
        tl.store(dst + LORA + dr, pe.to(cache_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _carried_or_loaded(blocks, bt_row, pos, in_ctx, PAGE: tl.constexpr):
    """This key tile's cache blocks: the ones the loop carried from the iteration before, else loaded now."""
    if blocks is None:
        blocks = tl.load(bt_row + pos // PAGE, mask=in_ctx, other=0).to(tl.int64)
    return blocks


@triton.jit
def mla_attention_kernel(
    q_c_ptr,  # [T, H, L] query folded through W_UK, last dim contiguous
    q_pe_ptr,  # [T, H, R] rotated rope query, last dim contiguous
    cache_ptr,  # [num_blocks, block_size, L + R]
    out_ptr,  # SPLIT_OUT: [num_tiles * QUERY_LEN, NUM_SPLITS, H, L] float32; else [T, H, L] (latent output)
    lse_ptr,  # SPLIT_OUT: [num_tiles * QUERY_LEN, NUM_SPLITS, H] float32 log2-sum-exp2 (-inf: empty split)
    tile_req_ptr,  # TILED: [num_tiles] int32 request of each tile
    tile_q0_ptr,  # TILE_Q0: [num_tiles] int32 first query row of each tile
    query_start_ptr, seq_lens_ptr, block_table_ptr, stride_bt,
    stride_qct, stride_qch, stride_qpt, stride_qph, stride_cb, stride_cs, stride_ot, stride_oh,
    sm_scale_log2,
    k_scale_ptr,  # float32 [1]: FP8_KV latents are stored / k_scale (read when FP8_KV)
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr,
    LORA: tl.constexpr, BLOCK_L: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    TILED: tl.constexpr, TILE_Q0: tl.constexpr, SPLIT_OUT: tl.constexpr, PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr, QUERY_LEN: tl.constexpr, FP8_KV: tl.constexpr,
    FP8_WORDS: tl.constexpr = False,  # FP8_KV read as int32 words, fp16 operands (triton_flash's _attend_tile)
    PDL: tl.constexpr = False,
    BLOCKS_AHEAD: tl.constexpr = False,  # each key tile's block numbers loaded in the iteration before
):
    """One program: BLOCK_Q query tokens of one request x BLOCK_H heads x one slice of the keys.

    SPLIT_OUT tiles cover a request's QUERY_LEN new tokens (1: decode; more: a uniform speculative
    verify step, BLOCK_Q >= QUERY_LEN) and write one partial per token, head and split."""
    pdl_enter(PDL)
    tile = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    req = tile  # pure decode: tile i is request i
    if TILED:
        req = tl.load(tile_req_ptr + tile)
    q0 = 0  # decode tiles: the request's only new token
    if TILE_Q0:
        q0 = tl.load(tile_q0_ptr + tile)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    r = tl.arange(0, BLOCK_M)
    q_tok = q0 + r // BLOCK_H
    head = head_block * BLOCK_H + r % BLOCK_H
    row_ok = (q_tok < q_len) & (head < NUM_HEADS)
    q_pos = ctx_len + q_tok
    tok = (q_start + q_tok).to(tl.int64)
    dl = tl.arange(0, BLOCK_L)
    dr = tl.arange(0, BLOCK_R)
    ql_mask = row_ok[:, None] & (dl[None, :] < LORA)
    qr_mask = row_ok[:, None] & (dr[None, :] < ROPE)
    q_c = tl.load(q_c_ptr + tok[:, None] * stride_qct + head[:, None] * stride_qch + dl[None, :],
                  mask=ql_mask, other=0.0)
    q_pe = tl.load(q_pe_ptr + tok[:, None] * stride_qpt + head[:, None] * stride_qph + dr[None, :],
                   mask=qr_mask, other=0.0)
    row_p2 = tl.full([BLOCK_M], 1.0, tl.float32)
    if FP8_WORDS:  # fp16 operands: q divided per row by the power of two at or below its largest |element|
        qcf, qpf = q_c.to(tl.float32), q_pe.to(tl.float32)
        top = tl.maximum(tl.max(tl.abs(qcf), 1), tl.max(tl.abs(qpf), 1))
        row_p2 = _pow2_at_or_below(top)
        q_c = (qcf / row_p2[:, None]).to(tl.float16)
        q_pe = (qpf / row_p2[:, None]).to(tl.float16)
    if DOT_F32:  # Triton's interpreter mis-multiplies 16-bit dot operands: give it float32
        q_c = q_c.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    # Keys this tile can see (causal up to its last query), cut into whole BLOCK_N tiles per split.
    hi_tile = tl.minimum(seq_len, ctx_len + q0 + BLOCK_Q)
    per_split = tl.cdiv(tl.cdiv(hi_tile, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, hi_tile)

    acc = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    # fp8: the stored latent times k_scale is the key and the value: the scale goes into the scores and,
    # once, into the output, and the tiles stay raw e4m3 values (exact in q's dtype)
    qk_scale = sm_scale_log2
    out_scale = 1.0
    if FP8_KV:
        out_scale = tl.load(k_scale_ptr)
        qk_scale = sm_scale_log2 * out_scale
    # BLOCKS_AHEAD: a tile's latent loads address blocks loaded in the iteration before (a loop-carried value), not
    # by a load in the same iteration, so the pipeliner can issue them more than a tile ahead (num_stages >= 3);
    # as triton_flash's split_decode_kernel (impl._BLOCKS_AHEAD has the sm_90 SASS).
    blocks = None
    if BLOCKS_AHEAD:
        blocks = _tile_blocks(bt_row, lo, hi, 0, BLOCK_N, PAGE)
    for n_start in range(lo, hi, BLOCK_N):
        pos = n_start + tl.arange(0, BLOCK_N)
        in_ctx = pos < hi
        block = _carried_or_loaded(blocks, bt_row, pos, in_ctx, PAGE)
        if BLOCKS_AHEAD:  # the next tile's (masked off past the slice)
            blocks = _tile_blocks(bt_row, n_start + BLOCK_N, hi, 0, BLOCK_N, PAGE)
        if FP8_WORDS:  # a slot's 576 bytes as 144 words (LORA, ROPE, strides multiples of 4)
            words = cache_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (
                block * stride_cb + (pos % PAGE).to(tl.int64) * stride_cs) // 4
            wl, wr = tl.arange(0, BLOCK_L // 4), tl.arange(0, BLOCK_R // 4)
            c = tl.load(words[:, None] + wl[None, :], mask=in_ctx[:, None] & (wl[None, :] < LORA // 4), other=0)
            c = _e4m3_words_to_f16(c, BLOCK_N, BLOCK_L)
            pe = tl.load(words[:, None] + LORA // 4 + wr[None, :], mask=in_ctx[:, None] & (wr[None, :] < ROPE // 4),
                         other=0)
            pe = _e4m3_words_to_f16(pe, BLOCK_N, BLOCK_R)
        else:
            base = cache_ptr + block * stride_cb + (pos % PAGE).to(tl.int64) * stride_cs
            c = tl.load(base[:, None] + dl[None, :], mask=in_ctx[:, None] & (dl[None, :] < LORA), other=0.0)
            pe = tl.load(base[:, None] + LORA + dr[None, :], mask=in_ctx[:, None] & (dr[None, :] < ROPE),
                         other=0.0)
            if FP8_KV:
                c = c.to(q_c_ptr.dtype.element_ty)
                pe = pe.to(q_c_ptr.dtype.element_ty)
        if DOT_F32:
            c = c.to(tl.float32)
            pe = pe.to(tl.float32)
            s = tl.dot(q_c, tl.trans(c), input_precision="ieee")
            s += tl.dot(q_pe, tl.trans(pe), input_precision="ieee")
        else:
            s = tl.dot(q_c, tl.trans(c), input_precision=PRECISION)
            s += tl.dot(q_pe, tl.trans(pe), input_precision=PRECISION)
        if FP8_WORDS:
            s = s * (qk_scale * row_p2)[:, None]  # [BLOCK_M, BLOCK_N]
        else:
            s = s * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = in_ctx[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None] * out_scale  # per split: the reduce is linear in it
    if SPLIT_OUT:
        part = ((tile.to(tl.int64) * QUERY_LEN + q_tok) * NUM_SPLITS + split) * NUM_HEADS + head
        # An empty split writes only its -inf lse; the reduce never reads its partial.
        tl.store(out_ptr + part[:, None] * LORA + dl[None, :], out, mask=ql_mask & ~empty[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(lse_ptr + part, lse, mask=row_ok)
    else:
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + dl[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=ql_mask)


@triton.jit
def mla_split_reduce_kernel(
    part_out_ptr,  # [num_tiles * QUERY_LEN, NUM_SPLITS, H, L] float32, normalized per split
    part_lse_ptr,  # [num_tiles * QUERY_LEN, NUM_SPLITS, H] float32
    out_ptr,  # [T, H, L]
    tile_req_ptr,  # TILED: [num_tiles] int32 request of each decode tile
    query_start_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    LORA: tl.constexpr, BLOCK_L: tl.constexpr, TILED: tl.constexpr, QUERY_LEN: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Combine the splits of one query token x one head (log-sum-exp weights); 0 for no context.
    Program 0 runs over decode tiles x QUERY_LEN tokens each."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    tile = row // QUERY_LEN
    j = row % QUERY_LEN
    if TILED:
        req = tl.load(tile_req_ptr + tile)
    else:
        req = tile
    s = tl.arange(0, SPLITS_PAD)
    dl = tl.arange(0, BLOCK_L)
    part = (row.to(tl.int64) * NUM_SPLITS + s) * NUM_HEADS + head
    lse = tl.load(part_lse_ptr + part, mask=s < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)
    o = tl.load(part_out_ptr + part[:, None] * LORA + dl[None, :],
                mask=(s[:, None] < NUM_SPLITS) & (lse[:, None] > float("-inf")) & (dl[None, :] < LORA), other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start  # a request without this token owns no row
    tok = q_start.to(tl.int64) + j
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + dl, out.to(out_ptr.dtype.element_ty),
             mask=(dl < LORA) & ((tl.zeros([BLOCK_L], dtype=tl.int32) + q_len) > j))
