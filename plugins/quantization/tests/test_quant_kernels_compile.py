"""The quantization plugin's Triton kernels compile for an H100 / H200 (sm_90) without a GPU, every
kind of variant the launchers use: fused activation quantization (dynamic and static; bf16 and fp32
inputs), the FP8 GEMM (W8A8; weight-only in bf16 and fp16), the weight-only fp8 GEMV (per-row and block scales),
the W8A8 small-M GEMM (per-token, static and block-fp8 activations quantized in it),
the int4 GEMM and GEMV (one scale row per tile, and gathered through g_idx; float32 split-K partials; the
GEMM's nibbles or-ed into bf16 / fp16 bits),
the int4 prefill dequantize and the split-K reduce. The interpreter accepts code the compiler rejects."""

from __future__ import annotations

import textwrap

import pytest
import torch

from keel.testing.sm90_compile import run_sm90_compile_script

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_quant.py runs them compiled")

SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from keel.testing.sm90_compile import constexpr_defaults
    from keel_quantization import (fp8_gemv_triton, fp8_quant_triton, fp8_triton, fp8_w8a8_small_m_triton,
                                   gather_columns, int4_dequant_triton, int4_gemv_fold_triton, int4_gemv_triton,
                                   int4_triton, splitk_reduce)

    def compile_(fn, sig, consts, **options):
        if "PDL" in fn.arg_names:  # with programmatic dependent launch, as sm_90 launches it once enabled
            consts = {**consts, "PDL": True}
        consts = {**constexpr_defaults(fn, {**sig, **consts}), **consts}  # as a launch that leaves them out
        src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
        out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options or None)
        assert "cubin" in out.asm

    i32 = "i32"
    for dt, statics in (("*bf16", (False, True)), ("*fp32", (False,))):
        sig = {"x_ptr": dt, "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "static_ptr": "*fp32", "M": i32, "K": i32, "GROUP": i32,
               "NUM_GROUPS": i32, **{s: i32 for s in ("stride_xm", "stride_xk", "stride_qm", "stride_qk",
                                                       "stride_sm", "stride_sg")}}
        for static in statics:
            # HW_CVT: the hardware convert rounds, as a GPU launch compiles it (the interpreter runs the other form)
            compile_(fp8_quant_triton._quant_fp8_kernel, sig,
                     {"STATIC": static, "GROUPS_PER_PROGRAM": 1 if static else 32, "BLOCK_G": 4096 if static else 128,
                      "HW_CVT": True},
                     num_warps=4)
            loop_sig = {k: v for k, v in sig.items() if k not in ("GROUP", "NUM_GROUPS", "stride_sg")}
            compile_(fp8_quant_triton._quant_fp8_row_loop_kernel, loop_sig,
                     {"STATIC": static, "CHUNK": 2048, "NUM_CHUNKS": 7, "HW_CVT": True}, num_warps=4)
    strides = ("stride_am", "stride_ak", "stride_asm", "stride_ask", "stride_bn", "stride_bk", "stride_bsn",
               "stride_bsk", "stride_cs", "stride_cm", "stride_cn")
    for a_dt, has_a_scale, tiles, group_n, group_k in (("*fp8e4nv", True, (64, 128, 128), 128, 128),
                                                        ("*bf16", False, (16, 32, 256), 1, 4096),
                                                        ("*fp16", False, (32, 32, 128), 128, 128)):
        sig = {"a_ptr": a_dt, "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32",
               "c_ptr": "*bf16" if a_dt != "*fp16" else "*fp16", "M": i32, "N": i32, "K": i32, "K_PER_SPLIT": i32,
               **{s: i32 for s in strides}}
        compile_(fp8_triton._fp8_gemm_kernel, sig,
                 {"GROUP_N": group_n, "GROUP_K": group_k, "UPCAST_DOT": False, "HAS_A_SCALE": has_a_scale,
                  "BLOCK_M": tiles[0], "BLOCK_N": tiles[1], "BLOCK_K": tiles[2], "SCALE_AFTER": False}, num_stages=4)
    # the variants the launchers build (fp8_triton.dot_constexprs over the plans these shapes get): W8A8 on fp8
    # activations (fp8_gemm's tiles) and weight-only in bf16 / fp32 models (small_m_plan.fp8_plan's "dot" plans),
    # one scale per row or per block (128, and 16 wide), decode and prefill M. Groups narrower than the fp8 MMA's
    # 32-wide K take an upcast dot, and the fp8 dot beside it must not be built at all: it was, past an early
    # return, and on an H100 the engine stopped at warm-up on a 16 x 16 block checkpoint
    import torch
    from keel_quantization import small_m_plan
    names = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}
    built = set()
    for a_dtype in (None, torch.bfloat16, torch.float32):  # None: W8A8, fp8 activations
        for group_n, group_k in ((1, 4096), (128, 128), (16, 16)):
            # (a float32 model's prefill tiles are left to the GPU tests: ~10 s each to build their float32 dots)
            for m in ((1,) if a_dtype is torch.float32 else (1, 256)):
                plan = (fp8_triton._tiles(m, group_k, 4096) if a_dtype is None
                        else small_m_plan.fp8_plan(m, 4096, 4096, group_k))
                if plan.kernel != "dot":
                    continue
                consts = fp8_triton.dot_constexprs(plan, group_n, group_k, a_dtype or torch.float8_e4m3fn, a_dtype is None,
                                                   on_cpu=False)
                out = "*fp32" if plan.split_k > 1 else names.get(a_dtype, "*bf16")
                key = (a_dtype, out, tuple(consts.items()), tuple(plan.launch_options().items()))
                if key in built:
                    continue
                built.add(key)
                compile_(fp8_triton._fp8_gemm_kernel,
                         {**sig, "a_ptr": names.get(a_dtype, "*fp8e4nv"), "c_ptr": out}, consts,
                         **plan.launch_options())
    assert any(dict(c)["UPCAST_DOT"] and dict(c)["HAS_A_SCALE"] for _, _, c, _ in built), built
    # per-row scales after the loop (benchmarks/h200_fp8_mid_m.py's candidates): fp8 sums promoted every K tile
    for a_dt, has_a_scale in (("*fp8e4nv", True), ("*bf16", False)):
        sig = {"a_ptr": a_dt, "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "c_ptr": "*bf16", "M": i32,
               "N": i32, "K": i32, "K_PER_SPLIT": i32, **{s: i32 for s in strides}}
        compile_(fp8_triton._fp8_gemm_kernel, sig,
                 {"GROUP_N": 1, "GROUP_K": 4096, "UPCAST_DOT": False, "HAS_A_SCALE": has_a_scale,
                  "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "SCALE_AFTER": True}, num_warps=8, num_stages=3)
    gemv_strides = ("stride_xm", "stride_xk", "stride_bn", "stride_bk", "stride_bsn", "stride_bsk", "stride_cs",
                    "stride_cm", "stride_cn")
    # weight-only, then on activations quantized in it (per token, per token and group, static)
    for c_dt, group_n, group_k, tiles, act in (("*fp32", 1, 4096, (1, 16, 512), 0), ("*bf16", 128, 128, (4, 8, 128), 0),
                                               ("*bf16", 1, 4096, (1, 8, 512), 1), ("*fp32", 128, 128, (1, 32, 128), 2),
                                               ("*bf16", 1, 4096, (2, 8, 512), 3)):
        sig = {"x_ptr": "*bf16", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "c_ptr": c_dt, "M": i32, "N": i32, "K": i32,
               "K_PER_SPLIT": i32, **{s: i32 for s in gemv_strides}, "static_ptr": "*fp32"}
        compile_(fp8_gemv_triton._fp8_gemv_kernel, sig, {"GROUP_N": group_n, "GROUP_K": group_k,
                                                         "BLOCK_M": tiles[0], "BLOCK_N": tiles[1], "BLOCK_K": tiles[2],
                                                         "SCALE_AFTER": group_k >= 4096, "ACT": act,
                                                         "AMAX_K": 4096 // tiles[0]})
        # the loop pipelined (plan num_stages 3: tl.range copies two tiles ahead through shared memory)
        compile_(fp8_gemv_triton._fp8_gemv_kernel, sig,
                 {"GROUP_N": group_n, "GROUP_K": group_k, "BLOCK_M": tiles[0], "BLOCK_N": tiles[1],
                  "BLOCK_K": tiles[2], "SCALE_AFTER": group_k >= 4096, "ACT": act, "AMAX_K": 4096 // tiles[0],
                  "STAGES": 3})
    w8a8_strides = ("stride_xm", "stride_xk", "stride_wn", "stride_wk", "stride_wsn", "stride_wsk", "stride_cs",
                    "stride_cm", "stride_cn")
    # per token over K (one split, bf16 out; 4 splits, fp32 partials), static, block fp8 (a scale per K tile)
    for act, c_dt, group_k, per_tile, tiles, rows in ((1, "*bf16", 0, False, (16, 64, 128), 1),
                                                      (1, "*fp32", 0, False, (32, 64, 128), 32),
                                                      (0, "*bf16", 0, False, (16, 64, 128), 4),
                                                      (2, "*fp32", 128, True, (16, 64, 128), 2)):
        sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "static_ptr": "*fp32", "c_ptr": c_dt,
               "M": i32, "N": i32, "K": i32, "K_PER_SPLIT": i32, **{s: i32 for s in w8a8_strides}}
        compile_(fp8_w8a8_small_m_triton._fp8_w8a8_small_m_kernel, sig,
                 {"ACT": act, "GROUP_N": 128 if per_tile else 1, "GROUP_K": group_k, "W_PER_TILE": per_tile,
                  "UPCAST_DOT": False, "BLOCK_M": tiles[0], "BLOCK_N": tiles[1], "BLOCK_K": tiles[2],
                  "QUANT_ROWS": rows, "AMAX_K": max(tiles[2], 4096 // rows), "PROMOTE_K": 32}, num_stages=4)
    # 16-wide block groups: K tiles under the fp8 MMA's 32, so the launcher upcasts the dot (as fp8_gemm's above)
    compile_(fp8_w8a8_small_m_triton._fp8_w8a8_small_m_kernel, sig,
             {"ACT": 2, "GROUP_N": 16, "GROUP_K": 16, "W_PER_TILE": True, "UPCAST_DOT": True, "BLOCK_M": 16,
              "BLOCK_N": 64, "BLOCK_K": 16, "QUANT_ROWS": 2, "AMAX_K": 2048, "PROMOTE_K": 16}, num_stages=4)
    for y_dt in ("*bf16", "*fp16"):
        sig = {"ws_ptr": "*fp32", "y_ptr": y_dt, "M": i32, "N": i32, "SPLITS": i32,
               **{s: i32 for s in ("stride_ws", "stride_wm", "stride_ym", "stride_yn")}}
        compile_(splitk_reduce._splitk_reduce_kernel, sig, {"BLOCK": 1024})
    sig = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "g_ptr": "*i32",
           "y_ptr": "*bf16", "M": i32, "N": i32, "K": i32, "K_PER_SPLIT": i32,
           **{s: i32 for s in ("stride_xm", "stride_xk", "stride_qk", "stride_qn", "stride_sg", "stride_sn",
                               "stride_ys", "stride_ym", "stride_yn")}}
    # the float path (MAGIC 0), then nibbles or-ed into bf16 128.0 / fp16 1024.0 (in-order groups only)
    for group, tiles, magic in ((128, (16, 32, 128), 0), (0, (64, 64, 128), 0), (128, (128, 128, 64), 0x4300)):
        consts = {"GROUP": group, "BLOCK_M": tiles[0], "BLOCK_N": tiles[1], "BLOCK_K": tiles[2], "DOT_F32": False,
                  "MAGIC": magic, "OFFSET": 128.0 if magic else 0.0}
        compile_(int4_triton._int4_gemm_kernel, sig, consts, num_warps=8 if tiles[0] > 64 else 4, num_stages=3)
        compile_(int4_triton._int4_gemm_kernel, {**sig, "y_ptr": "*fp32"},
                 {**consts, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128})
        if magic:
            continue
        for block_m in (1, 4):  # one row: the 2-D accumulator
            compile_(int4_gemv_triton._int4_gemv_kernel, {**sig, "y_ptr": "*fp32"},
                     {"GROUP": group, "BLOCK_M": block_m, "BLOCK_N": 32, "BLOCK_K": 128})
        for stages, bk in ((1, 1024), (3, 512), (4, 128)):  # gemv_fold, plain and pipelined (tl.range's stages)
            compile_(int4_gemv_fold_triton._int4_gemv_fold_kernel, {**sig, "y_ptr": "*fp32"},
                     {"GROUP": group, "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": bk, "EVEN": group != 0,
                      "STAGES": stages})
        compile_(int4_dequant_triton._int4_dequant_kernel,
                 {"qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "g_ptr": "*i32", "w_ptr": "*bf16",
                  **{s: i32 for s in ("N", "K", "stride_qk", "stride_sg", "stride_wk")}},
                 {"GROUP": group, "BLOCK_K": 128, "BLOCK_N": 128})
    compile_(int4_dequant_triton._int4_dequant_kernel,  # groups smaller than the tile: a scale row per word row
             {"qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "g_ptr": "*i32", "w_ptr": "*fp16",
              **{s: i32 for s in ("N", "K", "stride_qk", "stride_sg", "stride_wk")}},
             {"GROUP": 32, "BLOCK_K": 128, "BLOCK_N": 128})
    for index in ("*i64", "*i32"):  # act order's activation gather
        compile_(gather_columns._gather_columns_kernel,
                 {"x_ptr": "*bf16", "perm_ptr": index, "y_ptr": "*bf16", "M": i32, "K": i32, "stride_xm": i32,
                  "stride_ym": i32}, {"BLOCK_N": 1024})
    half = {**sig, "x_ptr": "*fp16", "s_ptr": "*fp16", "z_ptr": "*fp16", "y_ptr": "*fp16"}
    compile_(int4_triton._int4_gemm_kernel, half, {"GROUP": 128, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128,
                                                   "DOT_F32": False, "MAGIC": 0x6400, "OFFSET": 1024.0})
    print("compiled")
''')


def test_quantization_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    run_sm90_compile_script(SCRIPT)
