"""fp8 activation quantization fused into the producing RMSNorm / SiluAndMul (`keel.layers.input_quant`,
`fp8_input_fusion_triton`): the fused kernels give the unfused pair's bits (kernels-triton's norm / silu kernel,
then `quant_fp8`); a declared producer binds to a W8A8 layer's fusion only where it applies, and a bound pair
gives the unbound pair's output bit for bit, above and below the layer's small-M bound. On a GPU the kernels run
compiled (this file is in the device's test list), elsewhere interpreted."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("triton")
from keel_kernels_triton.ops import TritonFusedAddRMSNorm, TritonRMSNorm, TritonSiluAndMul  # noqa: E402
from keel_quantization import fp8_input_fusion_triton as fused  # noqa: E402
from keel_quantization import fp8_math, fp8_native  # noqa: E402
from keel_quantization.fp8_linear import Fp8LinearMethod, Fp8Scheme  # noqa: E402
from keel_quantization.fp8_quant_triton import quant_fp8  # noqa: E402

from keel.layers.activation import GeluAndMul, SiluAndMul  # noqa: E402
from keel.layers.input_quant import QuantizedInput, bind_input_quant  # noqa: E402
from keel.layers.layernorm import RMSNorm  # noqa: E402
from keel.layers.linear import ReplicatedLinear  # noqa: E402
from keel.models.loader import default_dtype  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def rand(*shape, dtype=torch.bfloat16, scale=3.0, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


@pytest.mark.parametrize("m,h,dtype", [(1, 64, torch.bfloat16), (7, 96, torch.bfloat16), (5, 4096, torch.bfloat16),
                                       (3, 80, torch.float16), (4, 48, torch.float32)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_norm_quant_is_the_norm_then_quant_fp8(m, h, dtype, residual, static):
    x, r, w = rand(m, h, dtype=dtype), rand(m, h, dtype=dtype, seed=1), rand(h, dtype=dtype, scale=1.0, seed=2)
    x[0, 0] = 0 if m > 1 else x[0, 0]  # a zero among the values, and a row of large values below
    x[-1] *= 50
    scale = torch.tensor([0.03], device=DEV) if static else None
    if residual:
        out, res = TritonFusedAddRMSNorm()(x, r, w, 1e-6)
    else:
        out, res = TritonRMSNorm()(x, w, 1e-6), None
    q_want, s_want = quant_fp8(out, h, scale)
    q, s, res_got = fused.rms_norm_quant(x, r if residual else None, w, 1e-6, scale)
    assert same_bits(q, q_want) and torch.equal(s, s_want)
    assert (res_got is None) == (res is None) and (res is None or torch.equal(res_got, res))


@pytest.mark.parametrize("m,d,chunk", [(1, 40, None), (6, 100, None), (4, 100, 32), (3, 64, 16), (2, 14336, None),
                                       (520, 8200, None), (2, fused.MAX_SILU_ROW + 8, None)])  # last: walked twice
@pytest.mark.parametrize("static", [False, True])
def test_silu_quant_is_silu_and_mul_then_quant_fp8(m, d, chunk, static):
    if m * d > 100_000 and DEV == "cpu":
        pytest.skip("a GPU size (the chunked launch at real widths); interpreted, the small chunked cases cover it")
    x = rand(m, 2 * d, scale=4.0)
    x[0, :d] = torch.linspace(-30, 30, d)  # saturating silu, both signs
    scale = torch.tensor([0.02], device=DEV) if static else None
    q_want, s_want = quant_fp8(TritonSiluAndMul()(x), d, scale)
    q, s = fused.silu_and_mul_quant(x, scale, chunk)
    assert same_bits(q, q_want) and torch.equal(s, s_want)


def test_empty_steps_and_row_views():
    q, s, res = fused.rms_norm_quant(rand(0, 32), rand(0, 32), rand(32), 1e-6, None)
    assert q.shape == (0, 32) and s.shape == (0, 1) and res.shape == (0, 32)
    wide = rand(3, 2 * 48)  # rows of a wider tensor: a row stride that is not the width
    q, s = fused.silu_and_mul_quant(wide[:, :48], None)
    q_want, s_want = quant_fp8(TritonSiluAndMul()(wide[:, :48].contiguous()), 24)
    assert same_bits(q, q_want) and torch.equal(s, s_want)


@pytest.mark.parametrize("m,width,group", [(3, 256, 128), (5, 384, 128), (4, 96, 32), (1, 200, 64)])
def test_grouped_and_cublas_layouts_are_quant_fp8s(m, width, group):
    from keel_quantization.fp8_cublas_block import quantize_activations

    x, r, w = rand(m, width), rand(m, width, seed=1), rand(width, scale=1.0, seed=2)
    x[0, : group // 2] *= 100  # one group much larger than its neighbours
    out, res = TritonFusedAddRMSNorm()(x, r, w, 1e-6)
    for chunk in (None, group):  # the default pass size, a group a pass
        q, s, res_got = fused.rms_norm_quant(x, r, w, 1e-6, None, group, chunk=chunk)
        assert same_bits(q, quant_fp8(out, group)[0]) and torch.equal(s, quant_fp8(out, group)[1])
        assert torch.equal(res_got, res)
    g = rand(m, 2 * width, scale=4.0, seed=3)
    act = TritonSiluAndMul()(g)
    for chunk in (None, group):
        q, s = fused.silu_and_mul_quant(g, None, chunk, group=group)
        assert same_bits(q, quant_fp8(act, group)[0]) and torch.equal(s, quant_fp8(act, group)[1])
    if width % 128 == 0:  # cuBLAS's block-scaled layout: rows padded to 4 (zeros), scales token-major
        for got, src in ((fused.rms_norm_quant(x, r, w, 1e-6, None, 128, 4)[:2], out),
                         (fused.rms_norm_quant(x, r, w, 1e-6, None, 128, 4, chunk=128)[:2], out),
                         (fused.silu_and_mul_quant(g, None, group=128, pad_to=4), act)):
            want = quantize_activations(src)
            assert same_bits(got[0], want[0]) and torch.equal(got[1], want[1])
            assert got[1].stride() == want[1].stride() and got[0].shape[0] == -(-m // 4) * 4


class Block(torch.nn.Module):
    """norm -> gate_up -> act -> down, the producers declared as a Llama model declares them."""

    def __init__(self, scheme: Fp8Scheme, native: str, small_m_max_m: int, h: int = 64, i: int = 96,
                 act: torch.nn.Module | None = None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        with default_dtype(dtype):
            self.norm = RMSNorm(h, 1e-6)
            self.up = ReplicatedLinear(h, 2 * i, False, quant_config=Fp8LinearMethod(scheme, "fp8"))
            self.down = ReplicatedLinear(i, h, False, quant_config=Fp8LinearMethod(scheme, "fp8"))
        self.act = act or SiluAndMul()
        g = torch.Generator().manual_seed(3)
        self.norm.weight.data.copy_(torch.rand(h, generator=g) + 0.5)
        for layer in (self.up, self.down):
            w = torch.randn(layer.output_size, layer.input_size, generator=g) * 0.1
            q, s = fp8_math.quantize_per_row(w) if scheme.block is None else fp8_math.quantize_blocks(w, scheme.block)
            layer.weight.data.copy_(q)
            getattr(layer, scheme.scale_name).data.copy_(s)
            if scheme.activation == "static":
                layer.input_scale.data.fill_(0.05)
            layer.to(DEV)
            layer.quant_method.process_weights_after_loading(layer)
            layer.quant_method.native, layer.quant_method.small_m_max_m = native, small_m_max_m
            layer.quant_method.native_scale = fp8_native.native_scale(native, getattr(layer, scheme.scale_name).data)
            layer.quant_method.small_m = "w8a8_small_m" if small_m_max_m else None
        # the unfused pair runs kernels-triton's kernels, whose rounding the fused ones reproduce
        self.norm.bound_ops = {"rms_norm": TritonRMSNorm(), "fused_add_rms_norm": TritonFusedAddRMSNorm()}
        if isinstance(self.act, SiluAndMul):
            self.act.bound_ops = {"silu_and_mul": TritonSiluAndMul()}
        self.up.set_input_producer(self.norm)
        self.down.set_input_producer(self.act)
        self.to(DEV)

    def forward(self, x, residual):
        h, residual = self.norm(x, residual)
        return self.down(self.act(self.up(h))), residual


NATIVE = "scaled_mm" if DEV == "cuda" else "triton"  # CPU torch has no bf16 row-wise _scaled_mm


BLOCK = Fp8Scheme("dynamic_group", (32, 32), "weight_scale_inv")
CUBLAS = pytest.param(
    Fp8Scheme("dynamic_group", (128, 128), "weight_scale_inv"), "cublas_block",
    marks=pytest.mark.skipif(DEV != "cuda" or torch.cuda.get_device_capability() != (9, 0),
                             reason="cuBLAS's block-scaled GEMM: sm90"))


@pytest.mark.parametrize("scheme,native", [(Fp8Scheme("dynamic_token"), NATIVE), (Fp8Scheme("static"), NATIVE),
                                           (BLOCK, "triton"), CUBLAS])
def test_a_bound_block_gives_the_unbound_blocks_bits_above_and_below_the_small_m_bound(scheme, native):
    h, i = (256, 384) if native == "cublas_block" else (64, 96)
    block = Block(scheme, native, small_m_max_m=4, h=h, i=i,
                  dtype=torch.float32 if native == "triton" and DEV == "cpu" else torch.bfloat16)
    dtype = block.norm.weight.dtype
    outs = {}
    for m in (2, 4, 5, 9):
        outs[m] = block(rand(m, h, seed=m, dtype=dtype), rand(m, h, seed=m + 1, dtype=dtype))
    assert bind_input_quant(block) == 2
    assert block.norm.fused_input_quant is not None and block.act.fused_input_quant is not None
    seen = []
    up_apply = block.up.quant_method.apply
    block.up.quant_method.apply = lambda mod, x, bias=None: seen.append(type(x)) or up_apply(mod, x, bias)
    for m, (want, want_res) in outs.items():
        got, res = block(rand(m, h, seed=m, dtype=dtype), rand(m, h, seed=m + 1, dtype=dtype))
        assert torch.equal(got, want) and torch.equal(res, want_res)
    assert seen == [torch.Tensor, torch.Tensor, QuantizedInput, QuantizedInput]  # fused only past the bound
    out = block.norm(rand(6, h, seed=11, dtype=dtype))
    assert isinstance(out, QuantizedInput) and out.num_tokens == 6  # no residual: the first layer's norm


@pytest.mark.parametrize("scheme,native,act", [
    (Fp8Scheme("dynamic_group", (32, 48), "weight_scale_inv"), "triton", None),  # groups not a power of two
    (Fp8Scheme("none"), "weight_only", None),  # no activation quantization
    (Fp8Scheme("dynamic_token"), None, None),  # the reference path: it rounds in torch itself
    (Fp8Scheme("dynamic_token"), NATIVE, GeluAndMul()),  # a producer with no fused op
])
def test_a_producer_is_bound_only_where_its_consumer_quantizes_in_a_launch_of_its_own(scheme, native, act, caplog):
    block = Block(scheme, native, small_m_max_m=0, act=act)
    with caplog.at_level(logging.INFO, logger="keel.input_quant"):
        bound = bind_input_quant(block)
    assert bound == (1 if act is not None else 0)  # the norm still fuses before a GeluAndMul's layer
    assert block.act.fused_input_quant is None if act is None else not hasattr(block.act, "fused_input_quant")
    if act is not None:
        assert "not fused into the producer of" in caplog.text and "GeluAndMul" in caplog.text


def test_wide_norms_stay_unfused():
    fusion = Fp8LinearMethod(Fp8Scheme("dynamic_token"), "fp8")
    fusion.native = NATIVE
    made = fusion.input_quant_fusion(torch.nn.Module())
    assert made.supports("rms_norm", fused.MAX_NORM_WIDTH) and not made.supports("rms_norm", fused.MAX_NORM_WIDTH + 1)
    assert made.supports("silu_and_mul", 28672) and not made.supports("gelu_and_mul", 64)


@pytest.mark.parametrize("scheme,native", [(Fp8Scheme("dynamic_token"), NATIVE), (BLOCK, "triton")])
def test_the_conformance_suite_passes_keels_fp8_fusion(scheme, native):
    from keel.testing.input_quant import check_input_quant_fusion

    dtype = torch.float32 if native == "triton" and DEV == "cpu" else torch.bfloat16
    block = Block(scheme, native, small_m_max_m=4, dtype=dtype)
    norm = check_input_quant_fusion(block.norm, block.up, lambda m: (rand(m, 64, seed=m, dtype=dtype),
                                                                     rand(m, 64, seed=m + 1, dtype=dtype)))
    act = check_input_quant_fusion(block.act, block.down, lambda m: (rand(m, 192, seed=m, dtype=dtype),))
    assert norm == act == {"min_m": 4, "fused_ms": [5, 64]}
    assert block.norm.fused_input_quant is None and block.act.fused_input_quant is None  # left unbound


def test_the_conformance_suite_names_a_method_without_a_fusion():
    from keel.testing.input_quant import check_input_quant_fusion

    block = Block(Fp8Scheme("none"), "weight_only", small_m_max_m=0)
    with pytest.raises(AssertionError, match="offers no activation fusion for a SiluAndMul producing 96 inputs"):
        check_input_quant_fusion(block.act, block.down, lambda m: (rand(m, 192, seed=m),))


def test_the_conformance_suite_catches_a_fusion_whose_numbers_differ(monkeypatch):
    from keel_quantization.fp8_linear import Fp8InputFusion

    from keel.testing.input_quant import check_input_quant_fusion

    call = Fp8InputFusion.__call__

    def off_by_a_bit(self, op, *args):  # a producer whose scales are 1% off
        out = call(self, op, *args)
        return QuantizedInput(out.values, out.scales * 1.01, out.dtype, out.num_tokens)

    monkeypatch.setattr(Fp8InputFusion, "__call__", off_by_a_bit)
    block = Block(Fp8Scheme("dynamic_token"), NATIVE, small_m_max_m=4)
    with pytest.raises(AssertionError, match="output at 5 tokens differs from the unfused pair's"):
        check_input_quant_fusion(block.act, block.down, lambda m: (rand(m, 192, seed=m),))


def test_fusions_merge_where_one_quantized_input_serves_both():
    from keel_quantization.fp8_linear import Fp8InputFusion

    cublas, triton = Fp8InputFusion(16, None, 128, 4), Fp8InputFusion(8, None, 128, 1)
    assert cublas.merge(triton) == triton.merge(cublas) == Fp8InputFusion(16, None, 128, 4)
    assert cublas.merge(Fp8InputFusion(8, None, None, 1)) is None  # per group vs per token
    static = Fp8InputFusion(8, torch.tensor([0.5]))
    assert static.merge(Fp8InputFusion(8, torch.tensor([0.5]))) == static
    assert static.merge(Fp8InputFusion(8, torch.tensor([0.25]))) is None  # two static scales
    assert static.merge(Fp8InputFusion(8, None)) is None


@pytest.mark.parametrize("pad_to", [1, 4])
def test_a_shared_producer_feeds_both_of_its_layers(pad_to, monkeypatch):
    """A norm read by two layers (DeepSeek's q_a and kv_a) binds once; both take its one QuantizedInput, also in
    cuBLAS's padded token-major layout (pad_to 4, as when one of them is a cuBLAS block layer) through strides."""
    from keel_quantization.fp8_linear import Fp8InputFusion

    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    block = Block(BLOCK, "triton", small_m_max_m=4, dtype=dtype)
    with default_dtype(dtype):
        side = ReplicatedLinear(64, 40, True, quant_config=Fp8LinearMethod(BLOCK, "fp8"))
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(9)) * 0.1
    q, s = fp8_math.quantize_blocks(w, BLOCK.block)
    side.weight.data.copy_(q)
    side.weight_scale_inv.data.copy_(s)
    side.bias.data.normal_()
    side.to(DEV)
    side.quant_method.process_weights_after_loading(side)
    side.quant_method.native, side.quant_method.small_m_max_m = "triton", 2
    side.set_input_producer(block.norm)
    block.side = side

    def both(m):
        h, res = block.norm(rand(m, 64, seed=m, dtype=dtype), rand(m, 64, seed=m + 1, dtype=dtype))
        return block.up(h), side(h), res

    want = {m: both(m) for m in (3, 5, 7)}
    offer = Fp8LinearMethod.input_quant_fusion
    monkeypatch.setattr(Fp8LinearMethod, "input_quant_fusion", lambda self, mod: (
        None if (f := offer(self, mod)) is None else Fp8InputFusion(f.min_m, f.static_scale, f.group,
                                                                    pad_to if mod is side else 1)))
    assert bind_input_quant(block) == 2  # the norm (for up and side), the activation (for down)
    assert block.norm.fused_input_quant == Fp8InputFusion(4, None, 32, pad_to)  # the larger min_m and padding
    for m, outs in want.items():
        for got, w in zip(both(m), outs):
            assert torch.equal(got, w)
    assert isinstance(block.norm(rand(7, 64, dtype=dtype), rand(7, 64, dtype=dtype))[0], QuantizedInput)
