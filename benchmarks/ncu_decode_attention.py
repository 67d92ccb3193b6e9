"""triton_flash's decode attention for Nsight Compute: what bounds it over an fp8 cache (issue slots, occupancy,
stalls, DRAM), beside the bf16 cache it reads at ~94% of copy bandwidth where fp8 reads at ~57% (H100; the same
time on an H200: SM-bound, not memory-bound).

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis -k regex:split_decode --csv --page details \
        python benchmarks/ncu_decode_attention.py [--shape 1024x192]

Llama-3-8B's GQA (32 q heads, 8 KV heads, head 128; 16-token pages) at the 1024-request harness's decode shape,
one split (the engine's choice at 1024 requests): the fp8 cache read as bytes at the engine's launch (64-token
tiles, 2 warps) and with 32-token tiles, as int32 words (loaded a tile ahead, as the word path ships, and inline
at 32-token / 2-warp, 64-token / 4-warp, 32-token / 4-warp and 64-token / 8-warp tiles: fewer registers a thread,
more warps resident), with block numbers loaded a tile ahead and three stages (the only form Triton pipelines
deeper than a tile), and the bf16 cache. Each case runs twice (the first compiles); the case order is printed
so ncu's rows can be named. No timing here: ncu's numbers are the result.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from h200_decode_attention import BLOCK, cache_and_scales, common_md, flash_launch

CASES = (  # (name, fp8, launch (tile, warps, stages[, True: block numbers loaded ahead]) or None: the engine's,
    # read fp8 as words, words loaded ahead)
    ("fp8_bytes_engine_launch", True, None, False, True),
    ("fp8_bytes_32x2x2", True, (32, 2, 2), False, True),
    ("fp8_words_engine_launch", True, None, True, True),
    ("fp8_words_inline_32x2x2", True, (32, 2, 2), True, False),
    ("fp8_words_inline_64x4x2", True, (64, 4, 2), True, False),
    ("fp8_words_inline_32x4x2", True, (32, 4, 2), True, False),
    ("fp8_words_inline_64x8x2", True, (64, 8, 2), True, False),
    ("fp8_bytes_64x2x3_blocks_ahead", True, (64, 2, 3, True), False, True),
    ("fp8_words_inline_64x4x3_blocks_ahead", True, (64, 4, 3, True), True, False),
    ("fp8_words_inline_32x2x3_blocks_ahead", True, (32, 2, 3, True), True, False),
    ("bf16_engine_launch", False, None, None, True),
)


def main() -> None:
    from keel_attention_flash.backend import TritonFlashAttentionBackend
    from keel_attention_flash.impl import TritonFlashAttentionImpl

    from keel.attention.backend import AttentionLayerConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1024x192", help="batch x context")
    a = ap.parse_args()
    batch, ctx = (int(v) for v in a.shape.split("x"))
    h, hkv, d = 32, 8, 128
    torch.manual_seed(0)
    common, num_blocks = common_md(batch, ctx)
    md = TritonFlashAttentionBackend.get_metadata_builder(torch.device("cuda")).build(common)
    q = torch.randn(batch, h, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(batch, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(batch, hkv, d, dtype=torch.bfloat16, device="cuda")
    for name, fp8, launch, words, ahead in CASES:
        cache, k_scale, v_scale = cache_and_scales((2, num_blocks, BLOCK, hkv, d), fp8)
        decode_launch, blocks_ahead = flash_launch(launch)
        impl = TritonFlashAttentionImpl(AttentionLayerConfig(h, hkv, d, d**-0.5, torch.bfloat16, BLOCK,
                                                             kv_cache_dtype=cache.dtype if fp8 else None),
                                        decode_splits=1, decode_launch=decode_launch, decode_fp8_words=words,
                                        decode_words_ahead=ahead, decode_blocks_ahead=blocks_ahead)
        if fp8:
            impl.set_kv_scales(k_scale, v_scale)
        for _ in range(2):
            impl.forward(q, k, v, cache, md)
        torch.cuda.synchronize()
        print("case", name, a.shape, flush=True)


if __name__ == "__main__":
    main()
