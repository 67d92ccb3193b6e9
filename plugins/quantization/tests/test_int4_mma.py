"""The swapped-operand int4 GEMM (int4_mma_triton: the dequantized weight as the MMA's register operand, its
nibble planes joined into one tile), interpreted on the CPU: the weight it multiplies is `int4_math.dequantize_int4`'s in
x's dtype, so its output is float64 x @ that weight^T up to float32 summation -- scale groups of 128 and one
group over K, symmetric and asymmetric zeros, M and N off the tile grid, fp16 and bf16, NaN-poisoned
outputs; the layouts it does not serve are refused by name. Then the kernel compiles for sm_90 with the
weight as the MMA's register operand and the MMAs overlapping the next tile's dequantize."""

from __future__ import annotations

import dataclasses
import re
import textwrap

import pytest
import torch
from keel_quantization import int4_math
from keel_quantization.quantizer_int4 import int4_tensors

pytest.importorskip("triton")
mma = pytest.importorskip("keel_quantization.int4_mma_triton")

TILE = mma.MmaTile(block_n=16, block_m=16, block_k=128, num_warps=4, num_stages=1)


def _case(m: int, k: int, n: int, group: int, sym: bool, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tensors, _ = int4_tensors("gptq", "x.weight", torch.randn(n, k, generator=gen), group_size=group, sym=sym,
                              desc_act=False, seed=seed)
    zeros = (int4_math.unpack_cols(tensors["x.qzeros"]) + 1).to(dtype)
    scales = tensors["x.scales"].to(dtype)
    w = int4_math.dequantize_int4(int4_math.unpack_rows(tensors["x.qweight"]), zeros, scales, tensors["x.g_idx"],
                                  dtype)  # [K, N]: the numbers the dequantize + cuBLAS path multiplies
    return torch.randn(m, k, generator=gen).to(dtype), tensors["x.qweight"], scales, zeros, w


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_quant.py runs it compiled")
@pytest.mark.parametrize("m,k,n,group,sym,dtype", [(1, 256, 40, 128, False, torch.bfloat16),
                                                   (20, 128, 16, -1, True, torch.bfloat16),
                                                   (5, 384, 24, 128, True, torch.float16)])
@pytest.mark.parametrize("split_k,pairs", [(1, False), (2, False), (2, True)])
def test_matches_the_dequantized_weight(m, k, n, group, sym, dtype, split_k, pairs):
    """split_k 2: K = 128 keeps one split; 256 two of a tile; 384 two of 2 and 1 tiles (float32 partials).
    pairs: the tile built as [BN, KW, 4, 2] (pair index, then the pair's two inputs), in the inputs' order."""
    x, qw, s, z, w = _case(m, k, n, group, sym, dtype, seed=m + k + n)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    tile = dataclasses.replace(TILE, split_k=split_k, pairs=pairs)
    mma.int4_mma_gemm(x, qw, s, z, k if group == -1 else group, out=out, tile=tile)
    ref = x.double() @ w.double()  # [M, N]
    # one output rounding, plus the interpreter's own rounding of the weight to x's dtype (its bf16 conversion
    # is not round-to-nearest: up to an ulp a weight; compiled, the kernel's weights are the reference's). A wrong
    # nibble, zero, scale or group is off by >= s |x| an input, over 16x that.
    bits = 8 if dtype == torch.bfloat16 else 11
    bound = 2.0**-bits * (ref.abs() + 2 * (x.double().abs() @ w.double().abs()))
    assert not out.isnan().any() and ((out.double() - ref).abs() <= bound).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_quant.py runs it compiled")
def test_refuses_what_it_does_not_serve():
    x, qw, s, z, _ = _case(2, 256, 16, 64, True, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="scale groups of 64"):
        mma.int4_mma_gemm(x, qw, s, z, 64, tile=TILE)
    with pytest.raises(ValueError, match="gathered"):
        mma.int4_mma_gemm(x, qw, s, z, 0, tile=TILE)
    with pytest.raises(ValueError, match="int4 mma tile"):
        mma.MmaTile(block_k=64)  # 8 word rows: under a bf16 MMA's K of 16
    assert "K 200" in mma.misfit(200, 200, TILE)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        mma.int4_mma_gemm(x.float(), qw, s, z, 256, tile=TILE)


COMPILE = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from keel_quantization import int4_mma_triton as mma

    i32 = "i32"
    names = list(mma._int4_mma_kernel.arg_names)
    for dt, (bn, bm, warps), pairs in (("*bf16", (128, 128, 8), False), ("*fp16", (64, 128, 4), False),
                                       ("*bf16", (64, 128, 4), True), ("*fp16", (64, 64, 4), True)):
        sig = {"x_ptr": dt, "qw_ptr": "*i32", "s_ptr": dt, "z_ptr": dt, "y_ptr": dt, "M": i32, "N": i32, "K": i32,
               "K_PER_SPLIT": i32, **{s: i32 for s in ("stride_xm", "stride_qk", "stride_sg", "stride_ys", "stride_ym")}}
        # as a launch on Llama's shapes specializes them: unit strides constant, the rest divisible by 16
        consts = {"stride_xk": 1, "stride_yn": 1, "GROUP": 128, "BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_K": 128,
                  "DOT_F32": False, "MAGIC16": 0x4300 if dt == "*bf16" else 0x6400,
                  "OFFSET": 128.0 if dt == "*bf16" else 1024.0, "PDL": True, "PAIRS": pairs}
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "y_ptr",
                                                                         "N", "K", "K_PER_SPLIT", "stride_xm",
                                                                         "stride_qk", "stride_sg", "stride_ys",
                                                                         "stride_ym")}
        src = ASTSource(fn=mma._int4_mma_kernel, signature={**sig, **{k: "constexpr" for k in consts}},
                        constexprs=consts, attrs=attrs)
        out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})
        with open(f"{dt[1:]}{'-pairs' if pairs else ''}.ptx", "w") as f:
            f.write(out.asm["ptx"])
    print("compiled")
''')


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_quant.py runs it compiled")
def test_compiles_for_sm90_with_the_weight_as_a_register_operand(tmp_path, monkeypatch):
    pytest.importorskip("triton.backends.nvidia")
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=180, check=False)
    if run.returncode and "ptxas" in run.stderr and "not found" in run.stderr.lower():
        pytest.skip("triton has no ptxas here")
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]
    ptx = (tmp_path / "bf16.ptx").read_text()
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16 [^;]*;", ptx)
    assert mmas, "no bf16 wgmma"
    # A from registers: the instruction's second operand is a register list {...}, not a shared-memory descriptor
    assert all(re.search(r"\{[^}]*\},\s*\{", m) for m in mmas), mmas[0]
    # the MMAs of one tile run while the next tile is dequantized (one group left in flight), not one plane's
    # MMA waited for before the next plane (what a dot a plane compiled to: wgmma.wait_group 0 after each)
    assert "wgmma.wait_group.sync.aligned 1" in ptx
    # operands arrive by cp.async; the joined weight tile goes to its MMA layout by stmatrix / ldmatrix, never
    # element by element through shared memory
    assert "cp.async" in ptx and "ldmatrix" in ptx and "st.shared.b16" not in ptx
    # pairs: a register of two neighbouring inputs is read as its halves, its byte taken from the word by one
    # permute against a zero (the planes' byte permutes join two registers: 72 PRMT a K tile in the sm_90 SASS,
    # benchmarks/sass_mix.py --mma), and the tile, built with the pair index as an axis, is made in the MMA
    # operand's layout: nothing of it is stored to shared memory (the planes' tile goes there and back each K
    # tile, st.shared + ldmatrix, with a barrier on either side)
    for dt in ("bf16", "fp16"):
        pairs = (tmp_path / f"{dt}-pairs.ptx").read_text()
        permutes = re.findall(r"prmt\.b32 [^;]*;", pairs)
        assert permutes and all(re.fullmatch(r"prmt\.b32 %r\d+, %r\d+, 0, %r\d+;", p) for p in permutes), permutes[:3]
        assert re.search(r"mov\.b32 \{", pairs) and "wgmma.wait_group.sync.aligned 1" in pairs
        assert "st.shared" not in pairs
