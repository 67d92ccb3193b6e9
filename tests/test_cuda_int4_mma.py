"""The mid-size int4 GEMM (keel_quantization.int4_mma_triton) on a GPU (skipped without one): compiled, against
float64 on the weights the dequantize pass writes (the same bf16 numbers), over M across and past the token
tiles, N off the weight-row tiles and tiles of each shape the benchmark sweeps, its 16-bit dequantize bit-equal
to its float32 one; and `int4_linear` routed to it
by a plan file for this device (int4_mma_plans), captured in a CUDA graph and replayed."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


def _layer(k: int, n: int, seed: int):
    from keel_quantization import int4_math
    from keel_quantization.quantizer_int4 import int4_tensors

    gen = torch.Generator().manual_seed(seed)
    t, _ = int4_tensors("gptq", "x.weight", torch.randn(n, k, generator=gen), group_size=128, sym=False,
                        desc_act=False, seed=seed)
    qw = t["x.qweight"].cuda()
    s = t["x.scales"].to(torch.bfloat16).cuda()
    z = (int4_math.unpack_cols(t["x.qzeros"]) + 1).to(torch.bfloat16).cuda()
    g_idx = t["x.g_idx"].to(torch.int32).cuda()
    w = int4_math.dequantize_int4(int4_math.unpack_rows(qw), z, s, g_idx, torch.bfloat16)  # [K, N]
    return qw, s, z, g_idx, w


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.double() @ w.double()
    bound = 2.0**-8 * ref.abs() + 2.0**-20 * (x.double().abs() @ w.double().abs())  # a rounding; float32 sums
    assert not out.isnan().any() and ((out.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("tile", [(128, 128, 8, 3), (128, 64, 8, 4), (64, 128, 4, 3), (64, 64, 4, 4),
                                  (64, 128, 4, 3, 3),  # split K: 8 tiles as 3 + 3 + 2
                                  (64, 16, 4, 4), (64, 32, 4, 4, 2)],  # token tiles for 16-48-token steps
                         ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("m", [1, 77, 256, 300])
def test_matches_float64_on_the_dequantized_weight(tile, m):
    from keel_quantization.int4_mma_plans import MmaTile
    from keel_quantization.int4_mma_triton import int4_mma_gemm

    k, n = 1024, 328
    qw, s, z, _, w = _layer(k, n, seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    t = MmaTile(tile[0], tile[1], 128, tile[2], tile[3], *tile[4:])
    int4_mma_gemm(x, qw, s, z, 128, out=out, tile=t)
    _check(out, x, w)
    # the 16-bit dequantize makes the float32 one's numbers: the same bits out; so does its pairs form
    assert torch.equal(out, int4_mma_gemm(x, qw, s, z, 128, tile=t, magic16=False))
    assert torch.equal(out, int4_mma_gemm(x, qw, s, z, 128, tile=dataclasses.replace(t, pairs=True)))
    xh, sh, zh = x.half(), s.half(), z.half()  # fp16's offset (1024.0) in the pairs form too
    assert torch.equal(int4_mma_gemm(xh, qw, sh, zh, 128, tile=t),
                       int4_mma_gemm(xh, qw, sh, zh, 128, tile=dataclasses.replace(t, pairs=True)))


def test_int4_linear_takes_it_where_a_plan_says_and_replays(tmp_path, monkeypatch):
    from keel_quantization import int4_linear, int4_mma_plans

    tile = dataclasses.asdict(int4_mma_plans.MmaTile(128, 64, 128, 8, 4))
    rows = [{"m": 100, "tile": tile}, {"m": 200, "tile": tile}]
    name = torch.cuda.get_device_name()
    (tmp_path / int4_mma_plans.device_file_name(name)).write_text(json.dumps({"bfloat16": rows}))
    monkeypatch.setenv(int4_mma_plans.CONFIG_DIR_ENV, str(tmp_path))
    int4_mma_plans.load_plans.cache_clear()
    try:
        k, n = 512, 256
        qw, s, z, g_idx, w = _layer(k, n, seed=3)
        method = int4_linear.Int4LinearMethod(int4_linear.Int4Format("gptq", 128, 1, False))
        layer = torch.nn.Module()
        layer.qweight, layer.scales, layer.zeros, layer.g_idx = qw, s, z, g_idx
        method.group_in_order = 128
        x = torch.randn(150, k, device="cuda", dtype=torch.bfloat16)
        eager = method.apply(layer, x)
        assert method.last_backend == "triton_mma"
        _check(eager, x, w)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = method.apply(layer, x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        _check(captured, x, w)
        method.apply(layer, torch.randn(201, k, device="cuda", dtype=torch.bfloat16))  # past the plan's sizes
        assert method.last_backend == "triton"
    finally:
        int4_mma_plans.load_plans.cache_clear()
