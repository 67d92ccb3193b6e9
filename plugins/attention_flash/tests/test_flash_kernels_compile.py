"""The attention plugin's Triton kernels compile for an H100 / H200 (sm_90) without a GPU, the variants the
impls launch: the cache writes (bf16 copy; FP8_KV quantizing into a uint8 view of the e4m3 cache; with the rope) and the
attention kernels over bf16 and e4m3 caches (the fp8 scales folded out of the tiles): varlen, split-K decode
(direct and into partials) and its reduce; MLA's latent write, decode and prefill tiles and reduce. The
interpreter accepts code the compiler rejects."""

from __future__ import annotations

import textwrap

import pytest
import torch

from keel.testing.sm90_compile import run_sm90_compile_script

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel tests run them compiled")

SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from keel.testing.sm90_compile import constexpr_defaults
    from keel_attention_flash import kernels, mla_kernels
    from keel_attention_flash.impl import _BATCH_LAUNCH, _BATCH_LAUNCH_FP8, _BATCH_LAUNCH_FP8_MANY, _SPLIT_LAUNCH

    def compile_(fn, ptrs, consts, **options):
        """Pointer types by name (else *i32 for tables); scalars i32 but the float32 score scale."""
        if "PDL" in fn.arg_names:  # compiled as sm_90 launches it: programmatic dependent launch on
            consts = {**consts, "PDL": True}
        consts = {**constexpr_defaults(fn, consts), **consts}  # as a launch that leaves them out
        sig = {}
        for name in fn.arg_names:
            if name in consts:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = ptrs.get(name, "*i32")
            else:
                sig[name] = "fp32" if name == "sm_scale_log2" else "i32"
        src = ASTSource(fn=fn, signature=sig, constexprs=consts)
        out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options or None)
        assert "cubin" in out.asm

    f32 = {"k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "slot_ptr": "*i64"}
    for fp8 in (False, True):
        cache = "*u8" if fp8 else "*bf16"  # the write's view of the cache
        compile_(kernels.reshape_and_cache_kernel, {**f32, "k_ptr": "*bf16", "v_ptr": "*bf16", "cache_ptr": cache},
                 {"NUM_KV_HEADS": 8, "HEAD": 128, "BLOCK_H": 8, "BLOCK_D": 128, "FP8_KV": fp8})
        compile_(kernels.rope_and_cache_kernel,  # Llama-8B's heads; the fp8 one with a partial rotary
                 {**f32, "q_ptr": "*bf16", "q_out_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
                  "cache_ptr": cache, "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"},
                 {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD": 128, "ROT": 64 if fp8 else 128, "HALF": 32 if fp8 else 64,
                  "BLOCK_H": 32, "BLOCK_HALF": 32 if fp8 else 64, "BLOCK_D": 128, "BLOCK_KVH": 8, "FP8_KV": fp8})
        compile_(mla_kernels.mla_write_latent_kernel,
                 {**f32, "kv_c_ptr": "*bf16", "k_pe_ptr": "*bf16", "cache_ptr": cache},
                 {"PAGE": 16, "LORA": 512, "BLOCK_L": 512, "ROPE": 64, "BLOCK_R": 64, "FP8_KV": fp8})
        read = {**f32, "cache_ptr": "*fp8e4nv" if fp8 else "*bf16", "q_ptr": "*bf16", "out_ptr": "*bf16",
                "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
        common = {"NUM_KV_HEADS": 8, "GROUP": 4, "HEAD": 128, "BLOCK_D": 128, "PAGE": 16, "WINDOW": 0,
                  "PRECISION": "tf32", "DOT_F32": False, "FP8_KV": fp8}
        compile_(kernels.varlen_paged_attention_kernel, read,
                 {**common, "G_PAD": 4, "BLOCK_Q": 16, "BLOCK_N": 64}, num_warps=4, num_stages=2)
        batch = _BATCH_LAUNCH_FP8 if fp8 else _BATCH_LAUNCH  # the impl's own launches (tile, warps, stages)
        for splits in (1, 4):
            tile, warps, stages = batch if splits == 1 else _SPLIT_LAUNCH
            compile_(kernels.split_decode_kernel, read,
                     {**common, "G_PAD": 16, "NUM_SPLITS": splits, "BLOCK_N": tile,
                      "QUERY_LEN": 1, "Q_PAD": 1, "DIRECT": splits == 1, "FP8_WORDS": False},
                     num_warps=warps, num_stages=stages)
        if fp8:  # the e4m3 cache read as int32 words, converted by inline PTX (the fp8 batch launch's tile),
            # the next tile's words loaded ahead (as shipped) and where each tile is attended
            tile, warps, stages = _BATCH_LAUNCH_FP8
            for ahead in (True, False):
                compile_(kernels.split_decode_kernel, read,
                         {**common, "G_PAD": 16, "NUM_SPLITS": 1, "BLOCK_N": tile, "QUERY_LEN": 1, "Q_PAD": 1,
                          "DIRECT": True, "FP8_WORDS": True, "WORDS_AHEAD": ahead}, num_warps=warps,
                         num_stages=stages)
            # the many-program launch: block numbers loaded a tile ahead (BLOCKS_AHEAD), bytes and words loaded
            # where attended (as shipped)
            tile, warps, stages = _BATCH_LAUNCH_FP8_MANY
            for words in (False, True):
                compile_(kernels.split_decode_kernel, read,
                         {**common, "G_PAD": 16, "NUM_SPLITS": 1, "BLOCK_N": tile, "QUERY_LEN": 1, "Q_PAD": 1,
                          "DIRECT": True, "FP8_WORDS": words, "WORDS_AHEAD": False, "BLOCKS_AHEAD": True},
                         num_warps=warps, num_stages=stages)
        mla = {"k_scale_ptr": "*fp32", "cache_ptr": "*fp8e4nv" if fp8 else "*bf16", "q_c_ptr": "*bf16",
               "q_pe_ptr": "*bf16"}
        shape = {"NUM_HEADS": 16, "LORA": 512, "BLOCK_L": 512, "ROPE": 64, "BLOCK_R": 64, "PAGE": 16,
                 "PRECISION": "tf32", "DOT_F32": False, "FP8_KV": fp8, "FP8_WORDS": False}
        for words in (False, True) if fp8 else (False,):  # True: the latent read as int32 words (inline PTX)
            compile_(mla_kernels.mla_attention_kernel, {**mla, "out_ptr": "*fp32", "lse_ptr": "*fp32"},
                     {**shape, "BLOCK_H": 16, "BLOCK_Q": 1, "BLOCK_N": 32, "NUM_SPLITS": 4, "TILED": True,
                      "TILE_Q0": False, "SPLIT_OUT": True, "QUERY_LEN": 1, "FP8_WORDS": words},
                     num_warps=4, num_stages=2)
        # block numbers a tile ahead with three stages (impl._BLOCKS_AHEAD), bytes or words, one split
        for words in (False, True) if fp8 else (False,):
            compile_(mla_kernels.mla_attention_kernel, {**mla, "out_ptr": "*bf16", "lse_ptr": "*bf16"},
                     {**shape, "BLOCK_H": 16, "BLOCK_Q": 1, "BLOCK_N": 32, "NUM_SPLITS": 1, "TILED": True,
                      "TILE_Q0": False, "SPLIT_OUT": False, "QUERY_LEN": 1, "FP8_WORDS": words,
                      "BLOCKS_AHEAD": True}, num_warps=4, num_stages=3)
        compile_(mla_kernels.mla_attention_kernel, {**mla, "out_ptr": "*bf16", "lse_ptr": "*bf16"},
                 {**shape, "BLOCK_H": 16, "BLOCK_Q": 2, "BLOCK_N": 32, "NUM_SPLITS": 1, "TILED": True,
                  "TILE_Q0": True, "SPLIT_OUT": False, "QUERY_LEN": 1}, num_warps=4, num_stages=2)
    compile_(kernels.split_reduce_kernel, {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16"},
             {"NUM_HEADS": 32, "NUM_SPLITS": 4, "SPLITS_PAD": 4, "HEAD": 128, "BLOCK_D": 128, "QUERY_LEN": 1})
    compile_(mla_kernels.mla_split_reduce_kernel,
             {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16"},
             {"NUM_HEADS": 16, "NUM_SPLITS": 4, "SPLITS_PAD": 4, "LORA": 512, "BLOCK_L": 512, "TILED": True,
              "QUERY_LEN": 1})
    print("compiled")
''')


def test_attention_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    run_sm90_compile_script(SCRIPT)
