"""The full int4 dequantize of prefill-sized steps (`int4_dequant_triton`), interpreted on the CPU: equal to the
reference decode (`int4_math.dequantize_int4`) in float32 and fp16, within one step in bf16 (the
interpreter's cast), for scale groups in order
(32 / 64 / 128, one group over K), a desc_act g_idx (gathered), symmetric and asymmetric zeros, K and N off
the tile grid, NaN-poisoned outputs (every element written); and `Int4LinearMethod` switching to it at
`DEQUANT_GEMM_MIN_M` tokens, with bias, against the dequantized reference."""

from __future__ import annotations

import pytest
import torch
from keel_quantization import int4_linear, int4_math
from keel_quantization.int4_linear import Int4Format, Int4LinearMethod, tileable_group
from keel_quantization.quantizer_int4 import int4_tensors
from quant_test_utils import reference_linear

from keel.layers.linear import ReplicatedLinear

pytest.importorskip("triton")
int4_dequant_triton = pytest.importorskip("keel_quantization.int4_dequant_triton")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda_quant.py runs it compiled")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("k,n,group,sym,desc_act", [(128, 136, 32, False, False), (200, 40, 64, True, False),
                                                    (256, 24, 128, False, False), (72, 56, -1, False, False),
                                                    (96, 72, 32, False, True)])
def test_dequantize_is_bit_equal_to_the_reference(dtype, k, n, group, sym, desc_act):
    gen = torch.Generator().manual_seed(k * 7 + n)
    tensors, _ = int4_tensors("gptq", "x.weight", torch.randn(n, k, generator=gen), group_size=group, sym=sym,
                              desc_act=desc_act, seed=k + n)
    qw, g_idx = tensors["x.qweight"], tensors["x.g_idx"].to(torch.int32)
    scales = tensors["x.scales"].to(dtype)
    zeros = (int4_math.unpack_cols(tensors["x.qzeros"]) + 1).to(dtype)
    want = int4_math.dequantize_int4(int4_math.unpack_rows(qw), zeros, scales, g_idx, dtype)  # [K, N]
    in_order = tileable_group(g_idx, k if group == -1 else group)
    assert bool(in_order) == (not desc_act)
    for group_size in {in_order, 0}:  # the in-order rule where it holds, and the g_idx gather always
        poisoned = torch.full((k, n), float("nan"), dtype=dtype)
        got = int4_dequant_triton.int4_dequantize(qw, scales, zeros, g_idx, dtype, group_size, out=poisoned)
        assert got.data_ptr() == poisoned.data_ptr()
        if dtype == torch.bfloat16:  # the interpreter's float32 -> bf16 cast is not round-to-nearest-even:
            # within one bf16 step here; tests/test_cuda_quant.py checks bit-equality compiled
            torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-7, atol=0)
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("block_k,block_n", [(16, 32), (32, 16), (64, 64)])
def test_tiles_within_a_group_and_across_groups(block_k, block_n):
    """A tile inside one group (one scale row a tile), tiles over several groups (a row per word row)."""
    k, n, group = 256, 48, 32
    tensors, _ = int4_tensors("gptq", "x.weight", torch.randn(n, k, generator=torch.Generator().manual_seed(3)),
                              group_size=group, sym=False, desc_act=False, seed=3)
    qw, g_idx = tensors["x.qweight"], tensors["x.g_idx"].to(torch.int32)
    scales, zeros = tensors["x.scales"].float(), (int4_math.unpack_cols(tensors["x.qzeros"]) + 1).float()
    want = int4_math.dequantize_int4(int4_math.unpack_rows(qw), zeros, scales, g_idx, torch.float32)
    tile = int4_dequant_triton.DequantTile(block_k, block_n, 4)
    got = int4_dequant_triton.int4_dequantize(qw, scales, zeros, g_idx, torch.float32, group,
                                              out=torch.full((k, n), float("nan")), tile=tile)
    assert torch.equal(got, want)


def test_shapes_that_do_not_fit_are_errors():
    qw = torch.zeros(8, 16, dtype=torch.int32)
    s = torch.ones(2, 16)
    with pytest.raises(ValueError, match="shapes do not fit"):
        int4_dequant_triton.int4_dequantize(qw, s, s, torch.zeros(32, dtype=torch.int32), torch.float32)
    with pytest.raises(ValueError, match="out must be"):
        int4_dequant_triton.int4_dequantize(qw, s, s, torch.zeros(64, dtype=torch.int32), torch.float32,
                                            out=torch.empty(64, 16, dtype=torch.bfloat16))


@pytest.mark.parametrize("desc_act", [False, True], ids=["in-order", "desc-act"])
def test_prefill_sized_steps_dequantize_then_multiply(monkeypatch, desc_act):
    monkeypatch.setattr(int4_linear, "DEQUANT_GEMM_MIN_M", 6)  # interpreted: small steps stand in for prefill
    fmt = Int4Format("gptq", 32, zero_offset=1, desc_act=desc_act)
    layer = ReplicatedLinear(96, 40, True, quant_config=Int4LinearMethod(fmt, backend="triton"))
    gen = torch.Generator().manual_seed(5)
    tensors, deq = int4_tensors("gptq", "x.weight", torch.randn(40, 96, generator=gen), group_size=32, sym=False,
                                desc_act=desc_act, seed=5)
    params = dict(layer.named_parameters())
    for name, t in tensors.items():
        p = params[name.rsplit(".", 1)[-1]]
        p.weight_loader(p, t)
    layer.bias.data.copy_(torch.randn(40, generator=gen))
    layer.quant_method.process_weights_after_loading(layer)
    for m, path in ((5, "triton"), (6, "triton_dequant"), (9, "triton_dequant")):
        x = torch.randn(m, 96, generator=gen)
        got = layer(x)
        assert layer.quant_method.last_backend == path
        torch.testing.assert_close(got.double(), reference_linear(x, deq, layer.bias), rtol=1e-4, atol=1e-4)
