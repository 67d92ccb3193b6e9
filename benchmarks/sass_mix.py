"""The instruction mix of a Triton kernel's main loop in sm_90 SASS, without a GPU: `triton.compile` for
GPUTarget("cuda", 90, 32) specialized as the JIT launches on the given shapes (ints equal to 1 become
constants, other ints and pointers divisible by 16), then Triton's bundled cuobjdump; the loop is the longest
backward branch. A count of what a thread issues per iteration predicts issue-bound kernels before a device
call (h200_int4_wdeq.py: 471 vs 322 instructions a tile predicted 1.46x, measured 1.4-1.8x).

    python benchmarks/sass_mix.py               # the int4 cases: GEMM, fold GEMV plans, dequantize

Run with the device's Triton (3.6) on the path: another version compiles other code.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ONES = ("stride_xk", "stride_qn", "stride_sn", "stride_yn")
MMA_ONLY = "--mma" in sys.argv  # only the int4 mma cases


def compile_sm90(fn, sig: dict, consts: dict, ones=ONES, **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts, sig = dict(consts), dict(sig)
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
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in body)
    regs = re.search(r"REG:(\d+)", res)
    return {"registers": int(regs.group(1)) if regs else None, "loop_instructions": len(body),
            "mix": dict(ops.most_common())}


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
    for bn, bk, w in ((16, 1024, 4), (32, 1024, 8), (32, 512, 4)):
        yield (f"int4 gemv_fold 1x{bn}x{bk} w{w} (M = 1)", int4_gemv_fold_triton._int4_gemv_fold_kernel,
               {k: v for k, v in gemm.items() if k != "M"},
               {"M": 1, "GROUP": 128, "BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_K": bk, "EVEN": True, "PREFETCH": False},
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


def main() -> None:
    import json

    for name, fn, sig, consts, options in _int4_cases():
        if MMA_ONLY and "mma" not in name:
            continue
        print(name, json.dumps(loop_mix(compile_sm90(fn, sig, consts, **options))))


if __name__ == "__main__":
    main()
