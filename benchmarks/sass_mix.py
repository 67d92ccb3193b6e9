"""The instruction mix of a Triton kernel's main loop in sm_90 SASS, without a GPU: `triton.compile` for
GPUTarget("cuda", 90, 32) specialized as the JIT launches on the given shapes (ints equal to 1 become
constants, other ints and pointers divisible by 16), then Triton's bundled cuobjdump; the loop is the longest
backward branch. A count of what a thread issues per iteration predicts issue-bound kernels before a device
call (h200_int4_wdeq.py: 471 vs 322 instructions a tile predicted 1.46x, measured 1.4-1.8x).

    python benchmarks/sass_mix.py               # the int4 cases: GEMM, fold GEMV plans, dequantize; fp8 GEMV pipelined
    python benchmarks/sass_mix.py --attention   # triton_flash / triton_mla decode over bf16 and fp8 caches (the
                                                # fp8 ones read as bytes and as words), the fused W8A8 input
                                                # quantizations, the rope-and-cache write

Run with the device's Triton (3.6) on the path: another version compiles other code (e.g. `pip install --target DIR
triton==3.6.0`, then PYTHONPATH=DIR).
"""

from __future__ import annotations

import collections
import itertools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ONES = ("stride_xk", "stride_qn", "stride_sn", "stride_yn", "stride_bk", "stride_bsk", "stride_cn")
MMA_ONLY = "--mma" in sys.argv  # only the int4 mma cases
ATTENTION = "--attention" in sys.argv  # the attention plugin's cases instead


def compile_sm90(fn, sig: dict, consts: dict, ones=ONES, **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from keel.testing.sm90_compile import constexpr_defaults

    consts, sig = {**constexpr_defaults(fn, consts), **consts}, dict(sig)  # as a launch that leaves them out
    if "PDL" in fn.arg_names and "PDL" not in consts:  # the kernel plugins' programmatic dependent launch
        consts["PDL"] = False
    for name in ones:
        if name in sig:
            sig.pop(name)
            consts[name] = 1
    full = {**sig, **{k: "constexpr" for k in consts}}
    names = fn.arg_names
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items() if v.startswith("*") or v == "i32"}
    src = ASTSource(fn=fn, signature={k: full[k] for k in names if k in full}, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options or None)


def loop_mix(compiled) -> dict:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    line = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*)")
    instrs = [(int(m.group(1), 16), m.group(2)) for m in map(line.match, sass.splitlines()) if m]
    loop = None
    for addr, text in instrs:
        b = re.search(r"BRA\s+(?:`?\(?)0x([0-9a-f]+)", text)
        if b and int(b.group(1), 16) < addr and (loop is None or addr - int(b.group(1), 16) > loop[1] - loop[0]):
            loop = (int(b.group(1), 16), addr)
    body = [t for a, t in instrs if loop and loop[0] <= a <= loop[1]]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in body or [t for _, t in instrs])
    regs = re.search(r"REG:(\d+)", res)
    return {"registers": int(regs.group(1)) if regs else None, "loop_instructions": len(body),
            "instructions": len(instrs), "mix": dict(ops.most_common())}  # no loop: the mix of the whole kernel


def _int4_cases():
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import h200_int4_wdeq
    from keel_quantization import int4_dequant_triton, int4_gemv_fold_triton, int4_mma_triton, int4_triton

    i32 = "i32"
    gemm = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "g_ptr": "*i32", "y_ptr": "*bf16",
            "M": i32, "N": i32, "K": i32, "K_PER_SPLIT": i32,
            **{s: i32 for s in ("stride_xm", "stride_xk", "stride_qk", "stride_qn", "stride_sg", "stride_sn",
                                "stride_ys", "stride_ym", "stride_yn")}}
    yield ("int4 GEMM 128x128x64 w8 s3 (bf16 nibbles)", int4_triton._int4_gemm_kernel, gemm,
           {"GROUP": 128, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "DOT_F32": False, "MAGIC": 0x4300,
            "OFFSET": 128.0}, {"num_warps": 8, "num_stages": 3})
    wdeq = {k: v for k, v in gemm.items() if k not in ("g_ptr", "K_PER_SPLIT", "stride_sn", "stride_ys")}
    yield ("h200_int4_wdeq 128x128x64 w8 s3", h200_int4_wdeq._wdeq_kernel, wdeq,
           {"GROUP": 128, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, {"num_warps": 8, "num_stages": 3})
    for bn, bk, w, stages in ((16, 1024, 4, 1), (32, 1024, 8, 1), (32, 512, 4, 1), (16, 512, 4, 1), (16, 512, 4, 4)):
        yield (f"int4 gemv_fold 1x{bn}x{bk} w{w} p{stages} (M = 1)", int4_gemv_fold_triton._int4_gemv_fold_kernel,
               {k: v for k, v in gemm.items() if k != "M"},
               {"M": 1, "GROUP": 128, "BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_K": bk, "EVEN": True, "STAGES": stages},
               {"num_warps": w})
    mma = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "y_ptr": "*bf16", "M": i32,
           "N": i32, "K": i32, "K_PER_SPLIT": i32, **{s: i32 for s in ("stride_xm", "stride_xk", "stride_qk",
                                                                     "stride_sg", "stride_ys", "stride_ym",
                                                                     "stride_yn")}}
    for pairs in (False, True):
        for bn, bm, w, st in ((128, 128, 8, 3), (128, 64, 8, 4), (64, 128, 4, 3), (128, 256, 8, 2), (64, 32, 4, 4),
                              (64, 16, 4, 4)):
            yield (f"int4 mma {bn}x{bm}x128 w{w} s{st} (weights as the register operand, bf16 dequantize"
                   + (", pairs)" if pairs else ")"),
                   int4_mma_triton._int4_mma_kernel,
                   mma, {"GROUP": 128, "BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_K": 128, "DOT_F32": False,
                         "MAGIC16": 0x4300, "OFFSET": 128.0, "PAIRS": pairs},
                   {"num_warps": w, "num_stages": st})
    yield ("int4 dequantize 128x128 w4", int4_dequant_triton._int4_dequant_kernel,
           {"qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "g_ptr": "*i32", "w_ptr": "*bf16",
            **{s: i32 for s in ("N", "K", "stride_qk", "stride_sg", "stride_wk")}},
           {"GROUP": 128, "BLOCK_K": 128, "BLOCK_N": 128}, {"num_warps": 4})


def _attention_cases():
    """Llama-8B's GQA decode (8 KV heads x 128, group 4 padded to 16 rows, the batch launches) and DeepSeek-V2-Lite's
    MLA decode (16 heads, 512 + 64 latent, 32-token tiles), as the engine launches them; the loop is one key tile."""
    from keel_attention_flash import kernels, mla_kernels

    i32 = "i32"
    flash = {"q_ptr": "*bf16", "cache_kv_stride": i32, "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
             "out_ptr": "*bf16", "stride_ot": i32, "stride_oh": i32, "query_start_ptr": "*i32", "seq_lens_ptr": "*i32",
             "block_table_ptr": "*i32", "stride_bt": i32, "stride_qt": i32, "stride_qh": i32, "sm_scale_log2": "fp32",
             "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    decode = {"NUM_KV_HEADS": 8, "GROUP": 4, "G_PAD": 16, "NUM_SPLITS": 1, "HEAD": 128, "BLOCK_D": 128, "PAGE": 16,
              "WINDOW": 0, "PRECISION": "tf32", "DOT_F32": False, "QUERY_LEN": 1, "Q_PAD": 1, "DIRECT": True}
    # (cache, words, tile, warps, words loaded ahead[, stages, block numbers loaded ahead])
    for cache, words, tile, warps, ahead, *more in (
            ("bf16", False, 32, 2, True), ("fp8e4nv", False, 32, 2, True), ("fp8e4nv", True, 32, 2, True),
            ("fp8e4nv", True, 32, 2, False), ("fp8e4nv", False, 64, 2, True), ("fp8e4nv", True, 64, 2, True),
            ("fp8e4nv", True, 64, 2, False), ("fp8e4nv", True, 64, 4, False), ("fp8e4nv", True, 32, 4, False),
            ("fp8e4nv", True, 64, 8, False), ("fp8e4nv", False, 64, 2, True, 3, True),
            ("fp8e4nv", True, 64, 4, False, 3, True), ("fp8e4nv", True, 32, 2, False, 3, True)):
        fp8 = cache != "bf16"
        stages, blocks = more or (2, False)
        kind = (" words" + ("" if ahead else " inline")) if words else ""
        yield (f"triton_flash decode {cache}{kind} {tile}-token tile w{warps} s{stages}"
               f"{' blocks ahead' if blocks else ''}",
               kernels.split_decode_kernel, {**flash, "cache_ptr": f"*{cache}"},
               {**decode, "BLOCK_N": tile, "FP8_KV": fp8, "FP8_WORDS": words, "WORDS_AHEAD": ahead,
                "BLOCKS_AHEAD": blocks}, {"num_warps": warps, "num_stages": stages})
    mla = {"q_c_ptr": "*bf16", "q_pe_ptr": "*bf16", "out_ptr": "*bf16", "lse_ptr": "*bf16", "tile_req_ptr": "*i32",
           "tile_q0_ptr": "*i32", "query_start_ptr": "*i32", "seq_lens_ptr": "*i32", "block_table_ptr": "*i32",
           "stride_bt": i32, **{k: i32 for k in ("stride_qct", "stride_qch", "stride_qpt", "stride_qph", "stride_cb",
                                                 "stride_cs", "stride_ot", "stride_oh")},
           "sm_scale_log2": "fp32", "k_scale_ptr": "*fp32"}
    shape = {"NUM_HEADS": 16, "BLOCK_H": 16, "BLOCK_Q": 1, "LORA": 512, "BLOCK_L": 512, "ROPE": 64, "BLOCK_R": 64,
             "BLOCK_N": 32, "PAGE": 16, "NUM_SPLITS": 1, "TILED": False, "TILE_Q0": False, "SPLIT_OUT": False,
             "PRECISION": "tf32", "DOT_F32": False, "QUERY_LEN": 1}
    # (cache, words, stages, block numbers loaded a tile ahead)
    for cache, words, stages, blocks in (("bf16", False, 2, False), ("fp8e4nv", False, 2, False),
                                         ("fp8e4nv", True, 2, False), ("bf16", False, 3, True),
                                         ("fp8e4nv", False, 3, True), ("fp8e4nv", True, 3, True)):
        yield (f"triton_mla decode {cache}{' words' if words else ''} w4 s{stages}{' blocks ahead' if blocks else ''}",
               mla_kernels.mla_attention_kernel, {**mla, "cache_ptr": f"*{cache}"},
               {**shape, "FP8_KV": cache != "bf16", "FP8_WORDS": words, "BLOCKS_AHEAD": blocks},
               {"num_warps": 4, "num_stages": stages})
    rope = {"pos_ptr": "*i64", "q_ptr": "*bf16", "q_out_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
            "slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "num_write": i32,
            **{k: i32 for k in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
                                "cache_kv_stride")}, "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    yield from _fused_quant_cases()
    for cache in ("bf16", "u8"):
        yield (f"rope_and_cache {'fp8' if cache == 'u8' else 'bf16'} (whole kernel)", kernels.rope_and_cache_kernel,
               {**rope, "cache_ptr": f"*{cache}"},
               {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD": 128, "ROT": 128, "HALF": 64, "BLOCK_H": 32,
                "BLOCK_HALF": 64, "BLOCK_D": 128, "BLOCK_KVH": 8, "FP8_KV": cache == "u8"}, {"enable_fp_fusion": False})


def _fused_quant_cases():
    """Llama-8B's W8A8 input quantization fused into its producers, one scale per token, as a 1024-token decode
    step launches them: SiluAndMul (a 14336-wide row whole, 16 warps) and RMSNorm with the residual add (4096)."""
    import triton.language as tl
    from keel_quantization import fp8_input_fusion_triton as f

    i32 = "i32"
    yield ("silu_and_mul_quant 14336 row, 16 warps (whole kernel)", f._silu_and_mul_quant_kernel,
           {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "static_ptr": "*fp32",
            **{k: i32 for k in ("M", "stride_x", "stride_q", "stride_sm", "stride_sg", "D")}},
           {"DT": tl.bfloat16, "STATIC": False, "CHUNK": 16384, "NUM_CHUNKS": 1, "GROUP": 16384, "HW_CVT": True},
           {"num_warps": 16})
    yield ("rms_norm_quant 4096 row with residual, 16 warps (whole kernel)", f._rms_norm_quant_kernel,
           {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
            "res_out_ptr": "*bf16", "static_ptr": "*fp32", "eps": "fp32",
            **{k: i32 for k in ("M", "stride_x", "stride_r", "stride_q", "stride_ro", "stride_sm", "stride_sg", "H")}},
           {"DT": tl.bfloat16, "HAS_RESIDUAL": True, "STATIC": False, "BLOCK": 4096, "GROUP": 4096, "CHUNK": 4096,
            "HW_CVT": True}, {"num_warps": 16})


def _fp8_gemv_cases():
    """The weight-only fp8 GEMV at M = 1 (fp8_gemv_triton; Llama-8B's fp8_row plan 1x8x512, one scale over K), its
    loop plain and pipelined (the plan's num_stages: tl.range's)."""
    from keel_quantization import fp8_gemv_triton

    i32 = "i32"
    sig = {"x_ptr": "*bf16", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "c_ptr": "*bf16", "static_ptr": "*fp32",
           **{k: i32 for k in ("M", "N", "K", "K_PER_SPLIT", "stride_xm", "stride_xk", "stride_bn", "stride_bk",
                               "stride_bsn", "stride_bsk", "stride_cs", "stride_cm", "stride_cn")}}
    for stages in (1, 3, 4):
        yield (f"fp8 gemv 1x8x512 w4 p{stages} (M = 1)", fp8_gemv_triton._fp8_gemv_kernel, sig,
               {"GROUP_N": 1, "GROUP_K": 4096, "BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 512, "SCALE_AFTER": True,
                "ACT": 0, "M": 1, "STAGES": stages}, {"num_warps": 4})


def main() -> None:
    import json

    cases = _attention_cases() if ATTENTION else itertools.chain(_int4_cases(), _fp8_gemv_cases())
    for name, fn, sig, consts, options in cases:
        if ATTENTION:  # no int is specialized to 1 there (the int4 cases' unit strides)
            print(name, json.dumps(loop_mix(compile_sm90(fn, sig, consts, ones=(), **options))))
            continue
        if MMA_ONLY and "mma" not in name:
            continue
        print(name, json.dumps(loop_mix(compile_sm90(fn, sig, consts, **options))))


if __name__ == "__main__":
    main()
