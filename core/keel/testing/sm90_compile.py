"""Compile check for Triton kernel plugins on machines without a GPU: the CPU interpreter accepts code the
compiler rejects (types changing across loops, dtype constexprs, unsupported casts), so a plugin's tests
lower each kernel variant to an sm_90 (H100 / H200) cubin with the ptxas that ships with Triton. The core
imports no kernel language: the script a test passes runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_sm90_compile_script(script: str) -> None:
    """Run `script` (which lowers Triton kernels to sm_90 cubins and prints "compiled") in a fresh
    interpreter without TRITON_INTERPRET; skip where Triton ships no ptxas."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                         check=False)
    if out.returncode and "ptxas" in out.stderr and "not found" in out.stderr.lower():
        pytest.skip("triton has no ptxas here")
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]


def constexpr_defaults(fn, given) -> dict:
    """The defaults of `fn`'s constexpr parameters (a Triton JITFunction's `params`) that `given` (names a compile
    script already sets) leaves out: a launch that omits one compiles its default as a constant, and a script
    must do the same -- left out of the signature it compiles as an i32 argument, so an `if` on it becomes a
    runtime branch of a program no launch runs."""
    return {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default and p.name not in given}
