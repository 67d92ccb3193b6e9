"""The per-layer forward of triton_mla: latent cache write, absorbed attention, W_UV.

Every row runs in the absorbed form (see `mla_kernels`): the query is folded through W_UK once per
step with one batched matmul, decode requests (and every request of a uniform speculative verify
step, q rows each) run the split-K latent kernel plus its reduce, other requests (prefill, chunked
prefill, uneven verification) run causal query tiles of the same kernel over their paged
latents, and W_UV maps the latent outputs to per-head values with a second batched matmul. The cache
is never expanded, for decode or prefill. (A small-batch GEMV for the two matmuls, W_UV reducing the splits in
its A load, lost to cuBLAS's batched GEMM and the reduce launch twice on an H100 and was removed: see
docs/architecture.md.)
"""

from __future__ import annotations

import torch

from keel.attention.backend import AttentionLayerConfig
from keel_attention_flash import kernels as flash_kernels
from keel_attention_flash import mla_kernels
from keel_attention_flash.impl import _pow2, _sm_count, choose_num_splits
from keel_attention_flash.mla_metadata import TritonMLAMetadata
from keel_attention_flash.pdl import pdl_kwargs

# Decode over an fp8 latent cache reads it as int32 words converted in registers, with fp16 operands (triton_flash's
# _FP8_WORDS). sm_90 SASS of the decode loop (16 heads, 32-token tiles) 1,508 -> 981
# instructions a thread, 255 -> 204 registers, no byte loads from shared memory (bf16 cache: 841; Triton 3.6,
# benchmarks/sass_mix.py --attention). On with block numbers a tile ahead (_BLOCKS_AHEAD): H100 at f11a884
# (h100-mla-attn-ab-f11a884.json), us at 256 x 192 / 256 x 640 / 64 x 1024 / 1 x 2048: shipped bytes 56.8 / 124.8 /
# 68.6 / 34.3, words ahead 54.5 / 115.5 / 61.8 / 32.4 (bytes ahead 56.3 / 126.9 / 66.1 / 34.9: no gain).
_FP8_WORDS = True
# The decode loop takes each key tile's block numbers from the iteration before (BLOCKS_AHEAD), with three stages
# by default. sm_90 SASS (Triton 3.6, 16 heads, 32-token tiles, 4 warps): as shipped the loop waits for every
# latent copy at its top (DEPBAR.LE SB0, 0x0), so no tile's loads overlap the tile before; ahead with three stages
# the wait leaves the next tile's in flight (0x2; fp8 bytes 0x1). Loop instructions / registers a thread: bf16
# 841 / 206 -> 924 / 176; fp8 words 981 / 204 -> 1,112 / 194 (benchmarks/sass_mix.py --attention). H100 at
# f11a884, bf16 cache, us at 256 x 192 / 256 x 640 / 64 x 1024 / 1 x 2048: 51.6 / 102.8 / 59.5 / 28.4 as shipped,
# 48.6 / 92.8 / 56.0 / 28.1 ahead (16 heads, 32-token tiles, 4 warps, 3 stages); 64-token tiles or 4 stages lose.
_BLOCKS_AHEAD = True


class TritonMLAImpl:
    """Created by `TritonMLABackend.get_impl(layer)` once per MLA layer; satisfies
    `keel.layers.mla_attention.MLAAttentionImpl`.

    `process_weights_after_loading` is called once by the layer after weight loading; `forward` every
    step. `decode_splits` fixes the split count of the decode kernel (tests); by default it follows
    `choose_num_splits`. `decode_launch` = (heads per program, key tile, warps, stages) of the decode
    kernel (`decode_blocks_ahead`: its loop loads block numbers a tile ahead, `_BLOCKS_AHEAD`) and
    `prefill_launch` = (heads per program, query tokens per program, key tile, warps, stages) of the prefill
    tiles, for tuning runs.
    """

    def __init__(self, layer: AttentionLayerConfig, decode_splits: int | None = None,
                 decode_launch: tuple[int, int, int, int] | None = None,
                 prefill_launch: tuple[int, int, int, int, int] | None = None,
                 decode_fp8_words: bool | None = None, decode_blocks_ahead: bool | None = None) -> None:
        extra = dict(layer.extra)
        self.num_heads = layer.num_heads
        self.kv_lora_rank: int = extra["kv_lora_rank"]
        self.qk_nope_head_dim: int = extra["qk_nope_head_dim"]
        self.qk_rope_head_dim: int = extra["qk_rope_head_dim"]
        self.v_head_dim: int = extra["v_head_dim"]
        self.sm_scale_log2 = layer.scale * flash_kernels.LOG2E
        self.precision = "ieee" if layer.dtype == torch.float32 else "tf32"
        self.block_l = max(16, _pow2(self.kv_lora_rank))
        self.block_r = max(16, _pow2(self.qk_rope_head_dim))
        self.decode_splits = decode_splits
        wide = self.block_l >= 256  # DeepSeek's L = 512: keep the float32 accumulator within registers
        block_h = max(16, min(_pow2(self.num_heads), 32 if wide else 64))
        # float32 latent tiles are twice the bytes: halve the key tile and drop pipelining to stay
        # inside shared memory.
        f32_wide = wide and layer.dtype == torch.float32
        key_tile = (16 if f32_wide else 32) if wide else 64
        self.blocks_ahead = _BLOCKS_AHEAD if decode_blocks_ahead is None else decode_blocks_ahead
        # 4 warps: on the H200 (benchmarks/h200_decode_attention.py) 8 warps cost 10-30% at every batch. Block
        # numbers a tile ahead pipeline only with a third stage.
        stages = 1 if f32_wide else (3 if self.blocks_ahead else 2)
        self.decode_launch = decode_launch or (block_h, key_tile, 8 if f32_wide else 4, stages)
        # Prefill tiles: rows = tokens x heads; 16 heads per program, as many tokens as fit 32/64 rows.
        self.prefill_block_h = max(1, min(_pow2(self.num_heads), 16))
        self.prefill_block_q = max(1, (32 if wide else 64) // self.prefill_block_h)
        if self.prefill_block_q * self.prefill_block_h < 16:
            self.prefill_block_q = -(-16 // self.prefill_block_h)
        self.prefill_block_n = key_tile
        self.prefill_warps = 4
        self.prefill_stages = 1 if f32_wide else 2
        if prefill_launch is not None:
            (self.prefill_block_h, self.prefill_block_q, self.prefill_block_n, self.prefill_warps,
             self.prefill_stages) = prefill_launch
        self.w_uk: torch.Tensor | None = None  # [H, N, L]
        self.w_uv_t: torch.Tensor | None = None  # [H, L, V]
        self.fp8_kv = layer.cache_dtype != layer.dtype
        self.k_scale: torch.Tensor | None = None  # fp8 latent caches: the layer's scale (keel.layers.kv_scales)
        # decode over an fp8 latent cache read as int32 words (_FP8_WORDS)
        words_fit = (self.fp8_kv and layer.dtype in (torch.bfloat16, torch.float16)
                     and self.kv_lora_rank % 4 == 0 and self.qk_rope_head_dim % 4 == 0)
        if decode_fp8_words and not words_fit:
            raise ValueError(f"triton_mla: decode_fp8_words needs an fp8 latent cache under a 16-bit model and "
                             f"latent / rope widths divisible by 4 (cache {layer.cache_dtype}, model {layer.dtype}, "
                             f"{self.kv_lora_rank} / {self.qk_rope_head_dim})")
        self.fp8_words = words_fit and (_FP8_WORDS if decode_fp8_words is None else decode_fp8_words)

    def set_kv_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Called once by the MLA layer when its latent cache is fp8; the latent uses `k_scale`."""
        self.k_scale = k_scale

    def process_weights_after_loading(
        self,
        w_uk: torch.Tensor,  # [H, N, L]
        w_uv: torch.Tensor,  # [H, V, L]
    ) -> None:
        self.w_uk = _refresh(self.w_uk, w_uk)
        self.w_uv_t = _refresh(self.w_uv_t, w_uv.transpose(1, 2))

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:  # (W_UK [H, N, L], W_UV^T [H, L, V])
        if self.w_uk is None or self.w_uv_t is None:
            raise RuntimeError(
                "triton_mla: process_weights_after_loading was never called; the model must hand over "
                "kv_b_proj's W_UK/W_UV after loading its weights"
            )
        return self.w_uk, self.w_uv_t

    def fold_query(self, q_nope: torch.Tensor) -> torch.Tensor:  # [T, H, N] -> [T, H, L]
        """W_UK folded into the query: [H, T, N] @ [H, N, L] -> [H, T, L], read as [T, H, L] by strides. Called
        by `forward`, or by the MLA layer beforehand on a side stream (`keel.layers.mla_attention`)."""
        w_uk, _ = self._weights()
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, N] (a strided view of the q projection)
        q_pe: torch.Tensor,  # [T, H, R]
        kv_c: torch.Tensor,  # [T, L]
        k_pe: torch.Tensor,  # [T, R]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
        metadata: TritonMLAMetadata,
        q_c: torch.Tensor | None = None,  # [T, H, L]: fold_query(q_nope), when the layer folded it already
    ) -> torch.Tensor:  # [T, H, V]
        _, w_uv_t = self._weights()
        num = metadata.num_actual_tokens
        if num:
            self.write_latent(kv_c[:num], k_pe[:num], kv_cache, metadata.common.slot_mapping)
        # The kernels read q_pe by its strides (the last one must be 1); no concatenation with q_c.
        q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
        if q_c is None:
            q_c = self.fold_query(q_nope)
        t = q_nope.shape[0]
        o_latent = torch.empty((t, self.num_heads, self.kv_lora_rank), dtype=q_nope.dtype, device=q_nope.device)
        if metadata.num_decodes:
            self._decode(q_c, q_pe, kv_cache, metadata, o_latent)
        if metadata.prefill_reqs:
            self._prefill(q_c, q_pe, kv_cache, metadata, o_latent)
        if metadata.num_query_rows < o_latent.shape[0]:
            o_latent[metadata.num_query_rows :].zero_()  # padding rows: unspecified, but never garbage
        # W_UV: [H, T, L] @ [H, L, V] -> [H, T, V], written through a transposed view of a contiguous
        # [T, H, V] (cuBLAS takes the strides), so the layer's reshape to [T, H * V] copies nothing (it was
        # a copy kernel per layer at every batch > 1).
        out = torch.empty((t, self.num_heads, self.v_head_dim), dtype=o_latent.dtype, device=o_latent.device)
        torch.bmm(o_latent.transpose(0, 1), w_uv_t, out=out.transpose(0, 1))
        return out

    def write_latent(
        self,
        kv_c: torch.Tensor,  # [num, L]
        k_pe: torch.Tensor,  # [num, R]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
        slot_mapping: torch.Tensor,  # [>= num] int64, -1 = skip
    ) -> None:
        """cat(kv_c, k_pe) of each token into its slot. fp8: quantized in the kernel and stored as
        quantize_kv's bytes through a uint8 view of the cache (see e4m3.py)."""
        kv_c = kv_c if kv_c.stride(-1) == 1 else kv_c.contiguous()
        k_pe = k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()
        cache = kv_cache.view(torch.uint8) if self.fp8_kv else kv_cache
        mla_kernels.mla_write_latent_kernel[(kv_c.shape[0],)](
            kv_c, k_pe, cache, slot_mapping, kv_c.stride(0), k_pe.stride(0),
            kv_cache.stride(0), kv_cache.stride(1), self.k_scale if self.fp8_kv else kv_c,
            PAGE=kv_cache.shape[1], LORA=self.kv_lora_rank, BLOCK_L=self.block_l, ROPE=self.qk_rope_head_dim,
            BLOCK_R=self.block_r, FP8_KV=self.fp8_kv, **pdl_kwargs(kv_c),
        )

    def _launch(self, grid: tuple[int, int, int], q_c: torch.Tensor, q_pe: torch.Tensor,
                kv_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                tile_req: torch.Tensor | None, tile_q0: torch.Tensor | None, md: TritonMLAMetadata,
                block_h: int, block_q: int, block_n: int, splits: int, warps: int, stages: int,
                query_len: int = 1, fp8_words: bool = False, blocks_ahead: bool = False) -> None:
        """One launch of the latent kernel: decode tiles into split partials (`lse` given) or prefill
        tiles straight into the latent output."""
        common = md.common
        split_out = lse is not None
        dummy = common.query_start_loc  # stands in for the tables the TILED / TILE_Q0 / SPLIT_OUT flags skip
        mla_kernels.mla_attention_kernel[grid](
            q_c, q_pe, kv_cache, out, lse if split_out else out,
            tile_req if tile_req is not None else dummy, tile_q0 if tile_q0 is not None else dummy,
            common.query_start_loc, common.seq_lens, common.block_table, common.block_table.stride(0),
            q_c.stride(0), q_c.stride(1), q_pe.stride(0), q_pe.stride(1),
            kv_cache.stride(0), kv_cache.stride(1),
            0 if split_out else out.stride(0), 0 if split_out else out.stride(1), self.sm_scale_log2,
            self.k_scale if self.fp8_kv else dummy,
            NUM_HEADS=self.num_heads, BLOCK_H=block_h, BLOCK_Q=block_q, LORA=self.kv_lora_rank,
            BLOCK_L=self.block_l, ROPE=self.qk_rope_head_dim, BLOCK_R=self.block_r, BLOCK_N=block_n,
            PAGE=kv_cache.shape[1], NUM_SPLITS=splits, TILED=tile_req is not None,
            TILE_Q0=tile_q0 is not None, SPLIT_OUT=split_out,
            PRECISION=self.precision, DOT_F32=q_c.device.type == "cpu", QUERY_LEN=query_len, FP8_KV=self.fp8_kv,
            FP8_WORDS=fp8_words, BLOCKS_AHEAD=blocks_ahead, num_warps=warps, num_stages=stages,
            **pdl_kwargs(q_c),
        )

    def _decode(self, q_c: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, md: TritonMLAMetadata,
                o_latent: torch.Tensor) -> None:
        """Split-K (flash-decoding) over the cached latents of every split-K request for its
        `md.query_len` new tokens, then the reduce into `o_latent`. Launch shapes depend only on
        (num_decodes, query_len, max_seq_len), never on the actual lengths."""
        b = md.num_decodes
        ql = md.query_len
        block_h, block_n, warps, stages = self.decode_launch
        block_q = _pow2(ql)
        # Same rows per program as decode (block_h >= 16 >= block_q): fewer heads, q tokens each.
        block_h = max(1, block_h // block_q)
        head_blocks = -(-self.num_heads // block_h)
        # One program per SM: a program holds every head's 512-wide latent accumulator, and past one
        # resident program per SM more splits only add partial traffic (H200, graphs' max_seq_len 4096:
        # batch 256 x 192 tokens 50 us with 1 split vs 69 us with the 4 that 4 programs per SM asked for).
        splits = self.decode_splits or choose_num_splits(b, head_blocks, md.max_seq_len,
                                                         _sm_count(q_c.device), programs_per_sm=1)
        if splits == 1:  # one split: straight into the latent output, no partials and no reduce
            self._launch((b, head_blocks, 1), q_c, q_pe, kv_cache, o_latent, None, md.decode_reqs, None,
                         md, block_h, block_q, block_n, 1, warps, stages, query_len=ql, fp8_words=self.fp8_words,
                         blocks_ahead=self.blocks_ahead)
            return
        part_out = torch.empty((b * ql, splits, self.num_heads, self.kv_lora_rank), dtype=torch.float32,
                               device=q_c.device)
        part_lse = torch.empty((b * ql, splits, self.num_heads), dtype=torch.float32, device=q_c.device)
        self._launch((b, head_blocks, splits), q_c, q_pe, kv_cache, part_out, part_lse, md.decode_reqs, None,
                     md, block_h, block_q, block_n, splits, warps, stages, query_len=ql, fp8_words=self.fp8_words,
                     blocks_ahead=self.blocks_ahead)
        tiled = md.decode_reqs is not None
        mla_kernels.mla_split_reduce_kernel[(b * ql, self.num_heads)](
            part_out, part_lse, o_latent, md.decode_reqs if tiled else md.common.query_start_loc,
            md.common.query_start_loc, o_latent.stride(0), o_latent.stride(1),
            NUM_HEADS=self.num_heads, NUM_SPLITS=splits, SPLITS_PAD=_pow2(splits), LORA=self.kv_lora_rank,
            BLOCK_L=self.block_l, TILED=tiled, QUERY_LEN=ql, **pdl_kwargs(q_c),
        )

    def _prefill(self, q_c: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, md: TritonMLAMetadata,
                 o_latent: torch.Tensor) -> None:
        """Causal query tiles of the requests with several new tokens, written straight to `o_latent`."""
        tile_req, tile_q0 = md.prefill_tiles(self.prefill_block_q)
        grid = (tile_req.numel(), -(-self.num_heads // self.prefill_block_h), 1)
        self._launch(grid, q_c, q_pe, kv_cache, o_latent, None, tile_req, tile_q0, md, self.prefill_block_h,
                     self.prefill_block_q, self.prefill_block_n, 1, self.prefill_warps, self.prefill_stages)


def _refresh(kept: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """`new` as a contiguous tensor; written into `kept` when that has its shape, dtype and device, so CUDA
    graphs captured before a weight reload read the reloaded values."""
    if kept is not None and kept.shape == new.shape and kept.dtype == new.dtype and kept.device == new.device:
        return kept.copy_(new)
    return new.contiguous()
