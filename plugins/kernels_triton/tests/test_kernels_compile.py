"""The kernels compile for an H100/H200 (sm_90) without a GPU: the interpreter accepts code that the
compiler rejects (types changing across loops, dtype constexprs), so lower every variant to a cubin with
the ptxas that ships with triton. Runs in a subprocess because this process interprets the kernels."""

from __future__ import annotations

import textwrap

import pytest
import torch
from triton_test_utils import run_sm90_compile_script

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="test_cuda_custom_ops.py runs them compiled")

SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from keel.testing.sm90_compile import constexpr_defaults
    from keel_kernels_triton import kernels as K

    def compile_(fn, sig, consts):
        if "PDL" in fn.arg_names:  # compiled as sm_90 launches it: programmatic dependent launch on
            sig, consts = {**sig, "PDL": "constexpr"}, {**consts, "PDL": True}
        extra = constexpr_defaults(fn, sig)  # as a launch that leaves them out
        sig, consts = {**sig, **{k: "constexpr" for k in extra}}, {**extra, **consts}
        out = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        assert "cubin" in out.asm

    i32, dt = "i32", "*bf16"
    norm = {"x_ptr": dt, "res_ptr": dt, "w_ptr": dt, "out_ptr": dt, "res_out_ptr": dt, "stride_x": i32,
            "stride_r": i32, "stride_o": i32, "stride_ro": i32, "H": i32, "eps": "fp32",
            "HAS_RESIDUAL": "constexpr", "BLOCK": "constexpr", "SINGLE": "constexpr"}
    for single in (True, False):
        for res in (True, False):
            compile_(K.rms_norm_kernel, norm, {"HAS_RESIDUAL": res, "BLOCK": 1024, "SINGLE": single})
    rope = {"pos_ptr": "*i64", "q_ptr": dt, "k_ptr": dt, "q_out_ptr": dt, "k_out_ptr": dt, "cos_ptr": "*fp32",
            "sin_ptr": "*fp32", "stride_q": i32, "stride_k": i32, "stride_qo": i32, "stride_ko": i32,
            "num_q_heads": i32, "num_k_heads": i32, "HEAD": "constexpr", "ROT": "constexpr", "HALF": "constexpr",
            "BLOCK_H": "constexpr", "BLOCK_HALF": "constexpr", "BLOCK_PASS": "constexpr"}
    compile_(K.rotary_kernel, rope, {"HEAD": 96, "ROT": 48, "HALF": 24, "BLOCK_H": 16, "BLOCK_HALF": 32,
                                     "BLOCK_PASS": 64})
    mla_rope = {"pos_ptr": "*i64", "q_ptr": dt, "k_ptr": dt, "q_out_ptr": dt, "k_out_ptr": dt,
                "cos_ptr": "*fp32", "sin_ptr": "*fp32", "stride_q": i32, "stride_qh": i32, "stride_k": i32, "num_heads": i32,
                "kv_ptr": dt, "kv_w_ptr": dt, "kv_out_ptr": dt, "stride_kv": i32, "lora": i32, "eps": "fp32",
                "ROT": "constexpr", "HALF": "constexpr", "BLOCK_H": "constexpr", "BLOCK_HALF": "constexpr",
                "INTERLEAVED": "constexpr", "BLOCK_L": "constexpr"}
    for interleaved in (True, False):  # DeepSeek-V2-Lite's 16 heads of 64 rope dims, its 512-wide latent
        compile_(K.mla_rope_kernel, mla_rope, {"ROT": 64, "HALF": 32, "BLOCK_H": 16, "BLOCK_HALF": 32,
                                               "INTERLEAVED": interleaved, "BLOCK_L": 512})
    silu = {"x_ptr": dt, "out_ptr": dt, "stride_x": i32, "stride_o": i32, "D": i32, "BLOCK": "constexpr"}
    compile_(K.silu_and_mul_kernel, silu, {"BLOCK": 1024})
    print("compiled")
''')


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    run_sm90_compile_script(SCRIPT)
