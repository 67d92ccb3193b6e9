"""Every decode-size GEMM plan the H200 sweep times (benchmarks/h200_quant_small_m.py: dot / gemv /
gemv_fold kernels, tiles, K splits; the W8A8 dot_w8a8 kernel) compiled on a GPU (skipped without one) against float64 on the operands
it multiplies, bf16 activations, NaN-poisoned outputs: weight-only fp8 with per-row and 128x128 block
scales (partial edge blocks), int4 with group 128 in order; M 1-64; W8A8 (per-token and per-token-group
activations quantized in the kernel) on those fp8 weights, M 1-32, against the activations
quantize_activations gives. A candidate the sweep could pick is a
correct one. And gemv_fold's gathered path (desc_act g_idx out of order) compiled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from keel.testing.scripts import load_script

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
fp8_math = pytest.importorskip("keel_quantization.fp8_math")
SWEEP = Path(__file__).resolve().parents[1] / "benchmarks" / "h200_quant_small_m.py"


@pytest.fixture(scope="module")
def sweep():
    return load_script(SWEEP)


def _operands(family: str, n: int, k: int, gen: torch.Generator):
    w = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
    family = family.removesuffix("_w8a8")
    if family == "fp8_row":
        q, s = fp8_math.quantize_per_row(w)
        return (q, s.reshape(-1, 1)), q.double() * s.double()[:, None]
    if family == "fp8_block":
        q, s = fp8_math.quantize_blocks(w, (128, 128))
        return (q, s), fp8_math.dequantize(q, s, (128, 128), torch.float64)
    words = torch.randint(-(1 << 31), 1 << 31, (k // 8, n), device="cuda", generator=gen, dtype=torch.int64)
    words = words.to(torch.int32)
    scales = torch.rand(k // 128, n, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    zeros = torch.randint(0, 16, scales.shape, device="cuda", generator=gen).to(torch.bfloat16)
    g_idx = torch.arange(k, device="cuda", dtype=torch.int32) // 128
    shifts = torch.arange(8, device="cuda", dtype=torch.int32) * 4
    q = ((words[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(k, n).double()  # [K, N]
    deq = ((q - zeros.double()[g_idx.long()]) * scales.double()[g_idx.long()]).T  # [N, K]
    return (words, scales, zeros, g_idx), deq


@pytest.mark.parametrize("family", ["fp8_row", "fp8_block", "int4_g128", "fp8_row_w8a8", "fp8_block_w8a8"])
def test_every_swept_plan_matches_float64(sweep, family):
    from keel_quantization.fp8_native import quantize_activations
    from keel_quantization.fp8_triton import fp8_weight_only_gemm
    from keel_quantization.fp8_w8a8_small_m_triton import fp8_w8a8_small_m_gemm
    from keel_quantization.int4_triton import int4_gemm

    from keel.layers.fp8_utils import dequant_per_token_group

    if family != "int4_g128" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 weights need sm89+")
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, k = 200, 1280  # a partial N tile / block; 10 K groups of 128
    weights, deq = _operands(family, n, k, gen)
    group = (1, k) if family.startswith("fp8_row") else (128, 128)
    act, block = ("dynamic_token", None) if family.startswith("fp8_row") else ("dynamic_group", (128, 128))
    for m in sweep.family_ms(family):
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        ref = x.double() @ deq.T
        if family.endswith("_w8a8"):  # on the e4m3 activations the large-M path multiplies
            a_q, a_s = quantize_activations(x, act, block, None)
            ref = dequant_per_token_group(a_q, a_s, group[1], torch.float64) @ deq.T
        for label, plan in sweep.candidates(family, m).items():
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            if family.endswith("_w8a8"):
                fp8_w8a8_small_m_gemm(x, *weights, *group, act, out=out, plan=plan)
            elif family == "int4_g128":
                int4_gemm(x, *weights, out=out, group_size=128, plan=plan)
            else:
                fp8_weight_only_gemm(x, *weights, *group, out=out, plan=plan)
            torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=2e-2, msg=f"{family} M={m} {label}")


@pytest.mark.parametrize("plan", [("gemv_fold", 1, 32, 128), ("gemv_fold", 4, 64, 64, 2)])
def test_gemv_fold_gathers_desc_act_groups_compiled(plan):
    from keel_quantization.int4_triton import int4_gemm
    from keel_quantization.small_m_plan import SmallMPlan

    gen = torch.Generator(device="cuda").manual_seed(1)
    n, k = 200, 1280
    (words, scales, zeros, g_idx), _ = _operands("int4_g128", n, k, gen)
    g_idx = g_idx[torch.randperm(k, device="cuda", generator=gen)]  # activation order: groups out of order
    shifts = torch.arange(8, device="cuda", dtype=torch.int32) * 4
    q = ((words[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(k, n).double()
    deq = (q - zeros.double()[g_idx.long()]) * scales.double()[g_idx.long()]  # [K, N]
    for m in (1, 3):
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        int4_gemm(x, words, scales, zeros, g_idx, out=out, group_size=0, plan=SmallMPlan(*plan))
        torch.testing.assert_close(out.double(), x.double() @ deq, atol=3e-2, rtol=2e-2, msg=f"M={m} {plan}")
