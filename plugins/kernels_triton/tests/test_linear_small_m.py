"""The unquantized small-M linear GEMV (kernels-triton's linear_small_m.py) and its `linear_small_m` op.

Interpreted on the CPU: odd shapes, 1-8 rows, one and several K slices, with and without bias, against a
float64 product rounded once; plans read from the override folder; the op binds only into layers whose
shape has a plan and leaves the others (and steps past max_m) on F.linear. Compiled for sm_90 without a
GPU; on a CUDA device run against F.linear, also replayed from a CUDA graph.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import torch.nn.functional as F
from keel_kernels_triton import linear_small_m as L
from keel_kernels_triton.ops import TritonLinearSmallM
from triton_test_utils import capture_cuda_graph, run_sm90_compile_script

from keel.layers.custom_op import bind_custom_ops
from keel.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from keel.plugins.loader import load_plugins

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _inputs(m, n, k, dtype, seed, device="cpu", bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x.to(device), w.to(device), (b.to(device) if b is not None else None)


def _check(got, x, w, b):
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == w.dtype and got.shape == ref.shape
    # rounded once from float32 sums of exact products: within one rounding of the exact result
    ulp = 2.0**-7 if w.dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=ulp)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_float64_reference(interpret, m, splits, dtype):
    x, w, b = _inputs(m, 37, 300, dtype, seed=m * 10 + splits, bias=m % 2 == 1)
    plan = L.LinearPlan(max_m=8, block_n=16, block_k=64, splits=splits)
    _check(L.linear_small_m(x, w, b, plan), x, w, b)


@pytest.mark.parametrize("m, splits", [(1, 1), (3, 3), (8, 2)])
def test_tiles_loaded_a_step_ahead_give_the_same_numbers(interpret, m, splits):
    """`ahead`: the next K step's weight tile loads before this one's multiply-adds, the last one masked past
    the slice (300 inputs: a partial last tile), bit for bit the plain loop's sums."""
    x, w, b = _inputs(m, 37, 300, torch.bfloat16, seed=7 + m, bias=True)
    plain = L.linear_small_m(x, w, b, L.LinearPlan(max_m=8, block_n=16, block_k=64, splits=splits))
    ahead = L.linear_small_m(x, w, b, L.LinearPlan(max_m=8, block_n=16, block_k=64, splits=splits, ahead=True))
    _check(ahead, x, w, b)
    assert torch.equal(plain, ahead)


def test_strided_rows_and_refusals(interpret):
    x, w, b = _inputs(4, 20, 128, torch.bfloat16, seed=1)
    wide = torch.cat([x, x], dim=1)[:, 128:]  # row stride 256
    plan = L.LinearPlan(max_m=4, block_n=8, block_k=32)
    _check(L.linear_small_m(wide, w, b, plan), x, w, b)
    with pytest.raises(ValueError, match="linear_small_m needs"):
        L.linear_small_m(torch.cat([x, x]), w, b, plan)  # 8 rows > max_m
    for bad in ({"max_m": 9}, {"block_n": 12}, {"splits": 0}, {"num_warps": 3}):
        with pytest.raises(ValueError, match="linear plan"):
            L.LinearPlan(**{"max_m": 1, "block_n": 16, "block_k": 64, **bad})


def _plan_file(folder, shapes, max_m=4):
    entry = {"max_m": max_m, "block_n": 16, "block_k": 64, "splits": 2, "num_warps": 4}
    (folder / "cpu.json").write_text(json.dumps({"bfloat16": {f"{n},{k}": entry for n, k in shapes}}))


def test_op_binds_only_where_a_plan_exists(interpret, tmp_path, monkeypatch):
    monkeypatch.setenv(L.CONFIG_DIR_ENV, str(tmp_path))
    L.load_plans.cache_clear()
    registry = load_plugins(["kernels-triton"]).registry("custom_op")
    assert registry.get("linear_small_m") is TritonLinearSmallM
    try:
        model = torch.nn.Sequential(ReplicatedLinear(64, 24, True), MergedColumnParallelLinear(64, [16, 16]))
        model.to(torch.bfloat16)
        assert "linear_small_m" not in bind_custom_ops(model, registry, "cpu", torch.bfloat16)  # no plan file
        _plan_file(tmp_path, [(24, 64)])
        L.load_plans.cache_clear()
        for layer in model:  # the layers allocate their parameters with torch.empty: garbage, NaN at times
            torch.nn.init.normal_(layer.weight, std=0.1)
            if layer.bias is not None:
                torch.nn.init.normal_(layer.bias, std=0.1)
            layer.bound_ops = {}
        assert bind_custom_ops(model, registry, "cpu", torch.bfloat16).get("linear_small_m") == 1
        first, second = model
        assert "linear_small_m" in first.bound_ops and "linear_small_m" not in second.bound_ops
        x, _, _ = _inputs(3, 1, 64, torch.bfloat16, seed=2)
        _check(first(x), x, first.weight.data, first.bias.data)
        many = torch.cat([x, x])  # 6 rows > max_m: F.linear itself
        assert torch.equal(first(many), F.linear(many, first.weight, first.bias))
    finally:
        L.load_plans.cache_clear()


def test_shipped_plan_files_are_valid_and_documented():
    """Every committed plan file parses into valid plans (a device named there would refuse its layers at bind
    time otherwise) and is named in the folder's README with the run that measured it."""
    readme = (L.CONFIG_DIR / "README.md").read_text()
    files = sorted(L.CONFIG_DIR.glob("*.json"))
    assert files, "the H100 plans are shipped"
    for path in files:
        assert f"`{path.name}`" in readme, path.name
        for dtype, table in json.loads(path.read_text()).items():
            assert dtype in ("bfloat16", "float16") and table, path.name
            for key, entry in table.items():
                n, k = (int(v) for v in key.split(","))
                assert n > 0 and k > 0 and L.LinearPlan(**entry).max_m >= 1


def test_compiles_for_sm90():
    run_sm90_compile_script(textwrap.dedent('''
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from keel_kernels_triton import linear_small_m as L

        sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32",
               "N": "i32", "K": "i32", "K_PER_SPLIT": "i32", "stride_xm": "i32", "stride_wn": "i32",
               "stride_om": "i32"}
        names = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "PARTIALS", "HAS_BIAS", "PDL", "AHEAD")
        for bm, bn, bk, partials, bias, ahead in ((1, 16, 256, False, False, True), (2, 16, 128, True, True, False),
                                                  (8, 8, 64, False, True, True), (1, 32, 512, True, False, False)):
            s = {**sig, **{k: "constexpr" for k in names}}
            if partials:
                s["out_ptr"] = "*fp32"
            consts = dict(zip(names, (bm, bn, bk, partials, bias, True, ahead)))
            out = triton.compile(ASTSource(fn=L._jitted(False), signature=s, constexprs=consts),
                                 target=GPUTarget("cuda", 90, 32))
            assert "cubin" in out.asm
        print("compiled")
    '''))


@needs_cuda
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("n,k,splits", [(2048, 2048, 1), (3648, 2048, 2), (4096, 14336, 4)])
def test_cuda_matches_reference_and_replays(m, n, k, splits):
    x, w, b = _inputs(m, n, k, torch.bfloat16, seed=m + n, device="cuda", bias=False)
    plan = L.LinearPlan(max_m=8, block_n=16, block_k=256, splits=splits)
    _check(L.linear_small_m(x, w, b, plan), x, w, b)
    static = x.clone()
    graph, out = capture_cuda_graph(lambda: L.linear_small_m(static, w, b, plan))
    fresh, _, _ = _inputs(m, n, k, torch.bfloat16, seed=99, device="cuda")
    static.copy_(fresh)
    graph.replay()
    _check(out, fresh, w, b)


def test_sweep_smoke_run_writes_a_plan_file(tmp_path):
    """benchmarks/h200_linear_small_m.py --smoke (interpreted, one tiny shape): the table and the results
    file in the formats the GPU run writes (the interpreter never wins, so the table is empty)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "benchmarks" / "h200_linear_small_m.py"
    subprocess.run([sys.executable, str(script), "--smoke", "--out-dir", str(tmp_path)], check=True, timeout=300,
                   capture_output=True, text=True)
    assert json.loads((tmp_path / "cpu.json").read_text()) == {"bfloat16": {}}
    result = json.loads((tmp_path / "h200-linear-small-m.json").read_text())
    assert result["results"][0]["shape"] == "tiny" and len(result["results"][0]["plans"]) == 2
