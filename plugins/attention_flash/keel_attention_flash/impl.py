"""The per-layer forward of triton_flash: launch the cache write, then decode or varlen attention."""

from __future__ import annotations

import math

import torch

from keel.attention.backend import AttentionLayerConfig
from keel_attention_flash import kernels
from keel_attention_flash.metadata import FlashAttentionMetadata
from keel_attention_flash.pdl import pdl_kwargs

# Decode splits: enough programs to fill the device a few times over, but no split shorter than this.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 16
# Programs per SM the split count aims at. Measured on the H200 as the graphs run decode
# (benchmarks/h200_decode_attention.py): at 8 KV heads a batch of 64 is fastest with one split (24 vs
# 30 us per layer with two), so 2, not 4.
_PROGRAMS_PER_SM = 2
# (tile tokens, warps, stages) of the decode kernel: one split per (request, KV head) when the batch
# alone fills the device -- there two warps per program let more programs stay resident (256 x 192 tokens:
# 64 vs 72 us; 256 x 640: 167 vs 185 us) -- and the long-tile launch when the context is split.
_BATCH_LAUNCH = (32, 2, 2)
_SPLIT_LAUNCH = (64, 4, 2)
# An fp8 cache's batch launch: its tiles hold half the bytes, and 64-token tiles move what bf16's 32 do per
# iteration (H100, benchmarks/h200_decode_attention.py --fp8: 64 x 1024 tokens 70 vs 100 us a layer; at 256 /
# 1024 x 192 within the run-to-run spread, 69 vs 68 and 238 vs 225-238 us). H200 at ef63271: 64 x 1024 68 vs 95,
# 1024 x 192 236 vs 217 (h200-fp8-1024-ef63271.json): the long contexts' 1.4x outweighs the short ones' 0.92x.
# From _WORDS_INLINE_MIN_PROGRAMS programs, with block numbers loaded a tile ahead (_BLOCKS_AHEAD), 32-token tiles
# at three stages (_BATCH_LAUNCH_FP8_MANY): H100 at f11a884 (h100-fp8-attn-ab-f11a884.json), 1024 x 192 (8,192
# programs) inline words 188 us against the (64, 2, 2) bytes' 240. Below it they lose: H100 at f7e3a77
# (h100-fp8-attn-verify-f7e3a77.json), 64 x 1024 (512 programs) 71.5 against (64, 2, 2) words ahead 67.5; 256 x 640
# (2,048) 169.3 against 162.5, but without block numbers ahead there (the benchmark turned them off): unsettled.
_BATCH_LAUNCH_FP8 = (64, 2, 2)
_BATCH_LAUNCH_FP8_MANY = (32, 2, 3)
# Decode over an fp8 cache reads it as int32 words converted in registers (kernels._e4m3_words_to_f16). sm_90 SASS
# of the 32-token loop 701 -> 516 instructions a thread, no byte loads from shared memory (bf16 cache: 423; Triton
# 3.6, benchmarks/sass_mix.py --attention); predicted 1024 x 192 tokens 238 -> ~160-180 us a layer. Measured (H200,
# ef63271, h200-fp8-1024-ef63271.json): 1024 x 192 237 -> 203 us, but 64 x 1024 (one split, 16 tiles a program)
# 67.6 -> 74.3, unexplained: the sm_90 SASS shows the word loads pipelined through shared memory (LDGSTS) as the
# byte path's are. A CUDA graph's launch sees max_model_len, not the step's contexts, so it cannot pick per
# context: off until the long-context loss is understood. Since then the word path pipelines itself in registers
# (split_decode_kernel: the next tile's words loaded before this tile is attended, from block numbers loaded an
# iteration earlier; 32-token loop 516 -> 621 instructions, 138 -> 186 registers). On an H100 (a4b3a3e,
# h100-fp8-quotient-c06cd97.json) it is within 1-2% of bytes at the engine's launch, ahead at both shapes
# (64 x 1024: 68.5 against 70.0 us, the long-context loss gone; 1024 x 192: 237.5 against 239.5): not worth a
# default until the H200, where the un-pipelined words were 14% ahead at 1024 x 192, has run it. On since the
# words loaded where attended take their block numbers a tile ahead (_BLOCKS_AHEAD): H100 at f11a884, 1024 x 192
# 188 us against bytes' 214 at the same launch; the 1,000-request harness 27,902 / 28,410 -> 28,814 / 29,241 out
# tok/s (h100-fp8-attn-ab-f11a884.json).
_FP8_WORDS = True
# The word path's next tile loaded ahead in registers, or each tile's words loaded where it is attended (fewer
# registers: sm_90 SASS 32-token tile 621 -> 523 instructions, 186 -> 144 registers). Ahead pays where each
# program's loop latency shows (few programs: 64 x 1024 tokens, 512 programs, one wave); inline where many waves
# hide it behind more resident warps. The inline form is the word path measured on the H200 at ef63271: 1024 x 192
# tokens (8,192 programs) 205 against bytes' 236 us, 64 x 1024 74 against 68. From this many programs (requests x
# KV heads x splits) a launch takes inline words; None: always ahead. Unset until the engine has run both
# (benchmarks/h200_decode_attention.py --fp8-words rows "inline"; ncu_decode_attention.py). 4096: the 1024 x 192
# step (8,192 programs) takes inline words with block numbers ahead at _BATCH_LAUNCH_FP8_MANY (188 us on the H100,
# against 234 ahead in registers); 64 x 1024 (512) and 256 x 640 (2,048) keep words ahead in registers at
# _BATCH_LAUNCH_FP8 (67.5 and 162.5 us; inline there 72.9 and 160.5). 4,096 itself is unmeasured.
_WORDS_INLINE_MIN_PROGRAMS: int | None = 4096
# The decode loop (bytes, or words not loaded ahead) with each tile's block numbers loaded an iteration early
# (split_decode_kernel's BLOCKS_AHEAD). Without it a tile's key / value addresses come from a block-table load in
# the same iteration, and Triton 3.6 pipelines no deeper than one tile whatever num_stages says: the sm_90 SASS
# waits for every copy at the top of the loop (DEPBAR.LE SB0, 0x0) and issues the next tile's copies at its end, after
# the block-table load, so each iteration pays a full load latency. With it and num_stages 3 the wait keeps the next
# tile's copies in flight (DEPBAR.LE SB0, 0x2), at no more registers (inline words 64-token / 4-warp 108, 536
# instructions; bytes 64 / 2 254 -> 206). The H200's fp8 decode took a near-constant ~3.3-3.8 us per key tile
# whatever its instruction count, as such a loop would. Prediction: 1024 x 192 fp8 decode 1.3-2x faster, the
# harness +5-12%. Measured (H100, f11a884, h200_run.sh part fp8-attn-ab): 240 -> 188 us (1.28x), the harness +3%.
# On where measured: an fp8 cache's many-program launch (_BATCH_LAUNCH_FP8_MANY, inline words or bytes).
_BLOCKS_AHEAD = True


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: keep grids small


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, sm_count: int,
                      programs_per_sm: int = _PROGRAMS_PER_SM) -> int:
    """Split count of flash-decoding for a step: a power of two in [1, 16] (few distinct compiles)."""
    by_occupancy = -(-programs_per_sm * sm_count // max(num_reqs * num_kv_heads, 1))
    by_length = -(-max_seq_len // _MIN_TOKENS_PER_SPLIT)
    wanted = max(1, min(_MAX_SPLITS, by_occupancy, by_length))
    return min(_MAX_SPLITS, _pow2(wanted))


class TritonFlashAttentionImpl:
    """Created by `TritonFlashAttentionBackend.get_impl(layer)` once per attention layer.

    `forward` is called by the layer every step. It writes the new tokens' K/V into the paged cache,
    then runs split-K flash-decoding when every request has the same few new tokens (decode, or a
uniform speculative verify step), else the varlen kernel over
    query tiles of the whole (mixed prefill + decode) batch. `decode_splits` fixes the split count
    (tests); by default it follows `choose_num_splits`.
    """

    def __init__(self, layer: AttentionLayerConfig, decode_splits: int | None = None,
                 decode_launch: tuple[int, int, int] | None = None, decode_fp8_words: bool | None = None,
                 decode_words_ahead: bool | None = None, decode_blocks_ahead: bool | None = None) -> None:
        self.layer = layer
        self.num_heads = layer.num_heads
        self.num_kv_heads = layer.num_kv_heads
        self.head_size = layer.head_size
        self.group = layer.num_heads // layer.num_kv_heads
        self.window = layer.sliding_window or 0
        self.decode_splits = decode_splits
        self.sm_scale_log2 = layer.scale * kernels.LOG2E
        self.precision = "ieee" if layer.dtype == torch.float32 else "tf32"
        self.block_d = _pow2(layer.head_size)
        self.block_n = 64 if self.block_d <= 128 else 32
        g_pad = _pow2(self.group)
        self.varlen_g_pad = g_pad
        self.block_q = max(1, 64 // g_pad) if self.block_d <= 128 else max(1, 32 // g_pad)
        if self.block_q * g_pad < 16:
            self.block_q = -(-16 // g_pad)
        self.decode_g_pad = max(16, g_pad)
        # (tile tokens, warps, pipeline stages) of the decode kernel; tuning runs fix it, else it follows
        # the split count (_BATCH_LAUNCH / _SPLIT_LAUNCH; wide heads keep their tile).
        self.decode_launch = decode_launch
        self.fp8_kv = layer.cache_dtype != layer.dtype
        # fp8 decode through word loads (_FP8_WORDS): 16-bit models (the tiles go fp16) with whole words per head
        words_fit = self.fp8_kv and layer.dtype in (torch.bfloat16, torch.float16) and layer.head_size % 4 == 0
        if decode_fp8_words and not words_fit:
            raise ValueError(f"triton_flash: decode_fp8_words needs an fp8 cache under a 16-bit model and a head size "
                             f"divisible by 4 (cache {layer.cache_dtype}, model {layer.dtype}, head {layer.head_size})")
        self.fp8_words = words_fit and (_FP8_WORDS if decode_fp8_words is None else decode_fp8_words)
        # the word path's next tile loaded ahead in registers; None: by the launch's program count
        # (_WORDS_INLINE_MIN_PROGRAMS)
        self.words_ahead = decode_words_ahead
        # block numbers an iteration early in the decode loop: a tuning run's choice, else _BLOCKS_AHEAD's at the
        # launch it was measured in (an fp8 cache's many-program launch)
        self.blocks_ahead = decode_blocks_ahead
        self.k_scale: torch.Tensor | None = None  # fp8 caches: the layer's scales (keel.layers.kv_scales)
        self.v_scale: torch.Tensor | None = None

    def _words_ahead(self, programs: int, rule_only: bool = False) -> bool:
        """Whether a launch of `programs` programs loads the next tile's words ahead in registers (below
        _WORDS_INLINE_MIN_PROGRAMS; a tuning run's decode_words_ahead unless `rule_only`, which also picks the fp8
        batch launch)."""
        if self.words_ahead is not None and not rule_only:
            return self.words_ahead
        return _WORDS_INLINE_MIN_PROGRAMS is None or programs < _WORDS_INLINE_MIN_PROGRAMS

    def set_kv_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Called once by the attention layer when its cache is fp8 (float32 [1] each)."""
        self.k_scale, self.v_scale = k_scale, v_scale

    def _scales(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.k_scale, self.v_scale) if self.fp8_kv else (like, like)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_size]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: FlashAttentionMetadata,
        kv_written: bool = False,  # the layer called write_kv_rope(...) already: k / v are not written again
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        common = metadata.common
        page = kv_cache.shape[2]
        n = metadata.num_actual_tokens
        if n and not kv_written:
            self.write_kv(k[:n], v[:n], kv_cache, common.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if metadata.is_decode:
            self._decode(q, kv_cache, metadata, out, page)
            rows = metadata.num_reqs * metadata.query_len
        else:
            self._varlen(q, kv_cache, metadata, out, page)
            rows = metadata.num_query_rows
        if rows < out.shape[0]:
            out[rows:].zero_()  # padding rows: unspecified, but never garbage
        return out

    def write_kv(
        self,
        k: torch.Tensor,  # [n, num_kv_heads, head_size], last dim contiguous
        v: torch.Tensor,  # [n, num_kv_heads, head_size], last dim contiguous
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        slot_mapping: torch.Tensor,  # [>= n] int64, -1 = skip
    ) -> None:
        """The cache write: one program per token. fp8: quantized in the kernel and stored as quantize_kv's
        bytes through a uint8 view of the cache (see e4m3.py)."""
        cache = kv_cache.view(torch.uint8) if self.fp8_kv else kv_cache
        kernels.reshape_and_cache_kernel[(k.shape[0],)](
            k, v, cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1), kv_cache.stride(0),
            *self._scales(k), NUM_KV_HEADS=self.num_kv_heads, HEAD=self.head_size,
            BLOCK_H=_pow2(self.num_kv_heads), BLOCK_D=self.block_d, FP8_KV=self.fp8_kv, **pdl_kwargs(k),
        )

    def write_kv_rope(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_size]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_size] (left unrotated)
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        positions: torch.Tensor,  # [num_tokens] int
        cos_cache: torch.Tensor,  # [cache_len, rotary_dim] float32 contiguous
        sin_cache: torch.Tensor,  # [cache_len, rotary_dim] float32 contiguous
        rotary_dim: int,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: FlashAttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size] contiguous: q rotated (q itself is left as it was)
        """Neox rope on q and k, and the cache write of the rotated k and v, in one launch (see
        `keel.layers.attention`): the rope op's rounding, `write_kv`'s bytes. The layer then calls
        `forward(q_rotated, k, v, ..., kv_written=True)`."""
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        n = q.shape[0]
        if n:
            half = rotary_dim // 2
            block_half = _pow2(half)
            cache = kv_cache.view(torch.uint8) if self.fp8_kv else kv_cache
            kernels.rope_and_cache_kernel[(n, 2)](
                positions, q, q_out, k, v, cache, metadata.common.slot_mapping, cos_cache, sin_cache,
                metadata.num_actual_tokens, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                v.stride(1), kv_cache.stride(0), *self._scales(k), NUM_HEADS=self.num_heads,
                NUM_KV_HEADS=self.num_kv_heads, HEAD=self.head_size, ROT=rotary_dim, HALF=half,
                BLOCK_H=min(_pow2(self.num_heads), max(1, 4096 // block_half)),
                BLOCK_HALF=block_half, BLOCK_D=self.block_d, FP8_KV=self.fp8_kv,
                BLOCK_KVH=min(_pow2(self.num_kv_heads), max(1, 4096 // self.block_d)), **pdl_kwargs(q),
                # no multiply-add contraction: float32's products and sums each rounded, as torch's rope
                # rounds them (16-bit dtypes round every product anyway)
                enable_fp_fusion=False,
            )
        return q_out

    def _varlen(self, q: torch.Tensor, kv_cache: torch.Tensor, md: FlashAttentionMetadata,
                out: torch.Tensor, page: int) -> None:
        tile_req, tile_q0 = md.tiles(self.block_q)
        if tile_req.numel() == 0:
            return
        common = md.common
        grid = (tile_req.numel(), self.num_kv_heads)
        kernels.varlen_paged_attention_kernel[grid](
            q, out, kv_cache, kv_cache.stride(0), tile_req, tile_q0,
            common.query_start_loc, common.seq_lens, common.block_table, common.block_table.stride(0),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), self.sm_scale_log2, *self._scales(q),
            NUM_KV_HEADS=self.num_kv_heads, GROUP=self.group, G_PAD=self.varlen_g_pad, BLOCK_Q=self.block_q,
            HEAD=self.head_size, BLOCK_D=self.block_d, BLOCK_N=self.block_n, PAGE=page, WINDOW=self.window,
            PRECISION=self.precision, DOT_F32=q.device.type == "cpu", FP8_KV=self.fp8_kv, **pdl_kwargs(q),
        )

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, md: FlashAttentionMetadata,
                out: torch.Tensor, page: int) -> None:
        """Split-K over each request's context for its `md.query_len` new tokens, then the reduce.
        Launch shapes depend only on (num_reqs, query_len, max_seq_len), never on the actual lengths."""
        b = md.num_reqs
        if b == 0:
            return
        common = md.common
        ql = md.query_len
        q_pad = _pow2(ql)
        # Rows = query tokens x padded group; keep at least 16 rows for tl.dot.
        g_pad = max(self.varlen_g_pad, -(-16 // q_pad)) if ql > 1 else self.decode_g_pad
        span = md.max_seq_len if not self.window else min(md.max_seq_len, self.window + ql - 1)
        splits = self.decode_splits or choose_num_splits(b, self.num_kv_heads, span, _sm_count(q.device))
        direct = splits == 1
        parts = 0 if direct else b * ql  # one split: the kernel writes `out` itself
        part_out = torch.empty((parts, splits, self.num_heads, self.head_size), dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty((parts, splits, self.num_heads), dtype=torch.float32, device=q.device)
        programs = b * self.num_kv_heads * splits
        ahead = self._words_ahead(programs)
        many = self.fp8_kv and splits == 1 and not self._words_ahead(programs, rule_only=True)
        blocks_ahead = _BLOCKS_AHEAD and many if self.blocks_ahead is None else self.blocks_ahead
        if self.decode_launch is not None:
            block_n, warps, stages = self.decode_launch
        else:
            batch = _BATCH_LAUNCH
            if self.fp8_kv:
                batch = _BATCH_LAUNCH_FP8_MANY if many else _BATCH_LAUNCH_FP8
            block_n, warps, stages = batch if splits == 1 else _SPLIT_LAUNCH
            block_n = min(block_n, self.block_n)
        if ql > 1 and q_pad * g_pad >= 64:
            warps = max(warps, 8)  # a tall tile: more warps keep the float32 accumulator in registers
        kernels.split_decode_kernel[(b, self.num_kv_heads, splits)](
            q, kv_cache, kv_cache.stride(0), part_out, part_lse, out, out.stride(0), out.stride(1),
            common.query_start_loc, common.seq_lens, common.block_table, common.block_table.stride(0),
            q.stride(0), q.stride(1), self.sm_scale_log2, *self._scales(q),
            NUM_KV_HEADS=self.num_kv_heads, GROUP=self.group, G_PAD=g_pad, NUM_SPLITS=splits,
            HEAD=self.head_size, BLOCK_D=self.block_d, BLOCK_N=block_n, PAGE=page, WINDOW=self.window,
            PRECISION=self.precision, DOT_F32=q.device.type == "cpu", QUERY_LEN=ql, Q_PAD=q_pad, DIRECT=direct,
            FP8_KV=self.fp8_kv, FP8_WORDS=self.fp8_words, WORDS_AHEAD=ahead, BLOCKS_AHEAD=blocks_ahead,
            num_warps=warps, num_stages=stages, **pdl_kwargs(q),
        )
        if direct:
            return
        kernels.split_reduce_kernel[(b * ql, self.num_heads)](
            part_out, part_lse, out, common.query_start_loc, out.stride(0), out.stride(1),
            NUM_HEADS=self.num_heads, NUM_SPLITS=splits, SPLITS_PAD=_pow2(splits), HEAD=self.head_size,
            BLOCK_D=self.block_d, QUERY_LEN=ql, **pdl_kwargs(q),
        )
