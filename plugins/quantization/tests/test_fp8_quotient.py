"""`fp8_quant_triton._quotient`: x / scale from the scale's reciprocal and two FMAs, against IEEE division
(torch's float32 `/`), on every finite bfloat16 value and the shared e4m3 edge list, at scales across float32's
range: powers of two, a reciprocal that rounds, the smallest the fast path takes (QUOTIENT_MIN_SCALE) and just
below it (the division instead), the dynamic minimum, huge ones. The quotient's bits where e4m3 can tell them
apart (|x / scale| in [2^-11, 2^16], signed zeros included), the stored e4m3 bytes everywhere (saturation; NaN:
the quotient stays NaN).
Interpreted on the CPU (its FMA rounds once), compiled on a GPU (this plugin's tests are in the device's list)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from keel_quantization import fp8_math  # noqa: E402
from keel_quantization.fp8_quant_triton import (  # noqa: E402
    QUOTIENT_MIN_SCALE,
    _reciprocal,
    _scaled,
    _to_e4m3_stored,
)

from keel.layers.fp8_utils import FP8, MIN_SCALE  # noqa: E402
from keel.testing.e4m3_edges import assert_same_e4m3_bytes, e4m3_edge_values  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 4096


@triton.jit
def _quotient_kernel(x_ptr, s_ptr, v_ptr, q_ptr, n, STATIC: tl.constexpr, HW_CVT: tl.constexpr,
                     BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    scale = tl.load(s_ptr)
    rcp = _reciprocal(scale)
    tl.store(v_ptr + i, _scaled(x, scale, rcp, STATIC), mask=i < n)
    tl.store(q_ptr + i, _to_e4m3_stored(x, scale, rcp, q_ptr.dtype.element_ty, HW_CVT, STATIC), mask=i < n)


def quotients(x: torch.Tensor, scale: float, static: bool) -> tuple[torch.Tensor, torch.Tensor]:
    v = torch.full(x.shape, float("nan"), device=DEV)
    q = torch.full(x.shape, 0x55, dtype=torch.uint8, device=DEV).view(FP8)
    _quotient_kernel[(triton.cdiv(x.numel(), BLOCK),)](x.to(DEV), torch.tensor([scale], device=DEV), v, q,
                                                       x.numel(), STATIC=static, HW_CVT=DEV == "cuda", BLOCK=BLOCK)
    return v.cpu(), q.cpu()


def every_bf16() -> torch.Tensor:  # float32 [n]: each finite bfloat16 value once, both zeros
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return bits[torch.isfinite(bits)]


def assert_quotients(x: torch.Tensor, scale: float, static: bool) -> None:
    v, q = quotients(x, scale, static)
    want = x / torch.tensor(scale)  # IEEE float32 division
    shown = want.isfinite() & (want.abs() >= 2.0**-11) & (want.abs() <= 2.0**16) | (want == 0)
    bad = (v.view(torch.int32) != want.view(torch.int32)) & shown
    assert not bad.any(), (f"scale {scale!r}: {int(bad.sum())} quotients differ, e.g. x={x[bad][:4].tolist()} "
                           f"got {v[bad][:4].tolist()} want {want[bad][:4].tolist()}")
    assert_same_e4m3_bytes(q, fp8_math.to_fp8(x, torch.tensor(scale)))


def test_nan_stays_nan():
    x = torch.tensor([float("nan"), -float("nan"), 1.0])
    for static in (True, False):
        v, _ = quotients(x, 0.5, static)
        assert v[:2].isnan().all() and v[2] == 2.0


SCALES = [1.0, 2.0**-7, 0.37, 3.0, 0.05, 1.0 / 3.0, 0.1234567, 7.25e-5, MIN_SCALE, QUOTIENT_MIN_SCALE,
          QUOTIENT_MIN_SCALE * 1.37, QUOTIENT_MIN_SCALE * 0.75, 2.0**-120, 1.5e20, 2.0**100]


@pytest.mark.parametrize("scale", SCALES)
def test_static_quotient_is_the_ieee_division(scale):
    """Static scales: any bfloat16 input (saturating, overflowing the product), a scale below the fast path's
    least (QUOTIENT_MIN_SCALE) taking the division."""
    edges = e4m3_edge_values(nan=False)  # NaN: below (the interpreter's saturation, tl.minimum, drops it)
    x = torch.cat((every_bf16(), edges * scale, edges))
    assert_quotients(x, scale, static=True)


@pytest.mark.parametrize("seed", range(4))
def test_dynamic_quotient_is_the_ieee_division(seed):
    """Dynamic scales: |x| <= 448 * scale (the product is not clamped), scale from a row's amax as quant_fp8 takes
    it, over rows whose amax spans float32's range; the row's inputs every bfloat16 value below its amax."""
    gen = torch.Generator().manual_seed(seed)
    everything = every_bf16()
    for amax in torch.logspace(-30, 30, 7).mul(torch.rand(7, generator=gen) + 0.5).tolist():
        x = everything[everything.abs() <= amax]
        scale = float(fp8_math.dynamic_scale(x.abs().amax()))
        assert_quotients(x, scale, static=False)


def test_infinite_dynamic_scale_divides_as_ieee():
    """A row holding inf has an infinite scale: finite inputs give +-0, inf gives NaN, as the division does."""
    x = torch.tensor([1.0, -2.5, 0.0, -0.0, 3e38, float("inf"), -float("inf")])
    v, _ = quotients(x, float("inf"), static=False)
    want = x / float("inf")
    assert torch.equal(v[:5].view(torch.int32), want[:5].view(torch.int32))
    assert v[5:].isnan().all()
