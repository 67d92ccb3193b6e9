"""FP8 linear layers against a float64 reference: fused shards keep their own scales, block scales land
on the right rows and columns (partial edge blocks, tensor-parallel slices), activations are quantized
per token / per token-group / statically. Parameters are poisoned with NaN before loading, so a slot
the loaders miss shows up in the output."""

from __future__ import annotations

import math

import pytest
import torch
from keel_quantization import fp8_math
from keel_quantization.fp8_linear import Fp8LinearMethod, Fp8Scheme
from quant_test_utils import reference_linear

from keel.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from keel.models.weights import WeightLoadError

FP8 = fp8_math.FP8


def poison(layer):
    for p in layer.parameters():
        p.data.fill_(float("nan"))


def ref_quant_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """Independent float64 restatement of per-token-group fp8 activation quantization."""
    out = torch.empty_like(x, dtype=torch.float64)
    for start in range(0, x.shape[1], group):
        chunk = x[:, start:start + group].double()
        s = (chunk.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=fp8_math.MIN_SCALE)
        out[:, start:start + group] = (chunk / s).clamp(-448, 448).to(FP8).double() * s
    return out


def ref_block_dequant(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    w = torch.empty(q.shape, dtype=torch.float64)
    bn, bk = block
    for i in range(math.ceil(q.shape[0] / bn)):
        for j in range(math.ceil(q.shape[1] / bk)):
            w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].double() * s[i, j]
    return w


def load(layer, name, tensor, shard=None):
    param = getattr(layer, name)
    if shard is None:
        param.weight_loader(param, tensor)
    else:
        param.weight_loader(param, tensor, shard)


def test_block_fp8_fused_qkv_keeps_each_shards_scales():
    block = (16, 16)
    layer = QKVParallelLinear(64, 16, 4, 2, quant_config=Fp8LinearMethod(Fp8Scheme("dynamic_group", block,
                                                                                  "weight_scale_inv"), "fp8"))
    poison(layer)
    g = torch.Generator().manual_seed(0)
    shards = {"q": torch.randn(64, 64, generator=g), "k": torch.randn(32, 64, generator=g) * 5,
              "v": torch.randn(32, 64, generator=g) * 0.01}
    dense = []
    for sid, w in shards.items():
        q, s = fp8_math.quantize_blocks(w, block)
        load(layer, "weight", q, sid)
        load(layer, "weight_scale_inv", s, sid)
        dense.append(ref_block_dequant(q, s, block))
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(5, 64, generator=g)
    got = layer(x)
    want = reference_linear(ref_quant_groups(x, 16), torch.cat(dense))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,cols,block", [(40, 64, (16, 16)), (576, 256, (128, 128)), (40, 50, (16, 16))])
def test_block_fp8_partial_edge_blocks(rows, cols, block):
    # DeepSeek-V3's kv_a_proj_with_mqa: 576 = 4.5 blocks of 128 rows; the last block has 64.
    layer = ReplicatedLinear(cols, rows, True, quant_config=Fp8LinearMethod(
        Fp8Scheme("dynamic_group", block, "weight_scale_inv"), "fp8"))
    poison(layer)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(rows, cols, generator=g)
    q, s = fp8_math.quantize_blocks(w, block)
    assert s.shape == (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    load(layer, "weight", q)
    load(layer, "weight_scale_inv", s)
    bias = torch.randn(rows, generator=g)
    load(layer, "bias", bias)
    x = torch.randn(3, cols, generator=g)
    want = reference_linear(ref_quant_groups(x, block[1]), ref_block_dequant(q, s, block), bias)
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)


def test_per_tensor_static_merged_gate_up():
    layer = MergedColumnParallelLinear(32, [48, 48], quant_config=Fp8LinearMethod(Fp8Scheme("static"), "fp8"))
    poison(layer)
    g = torch.Generator().manual_seed(2)
    dense, in_scales = [], [0.01, 0.02]
    for sid in (0, 1):
        w = torch.randn(48, 32, generator=g) * (1 + 3 * sid)
        q, s = fp8_math.quantize_per_tensor(w)
        load(layer, "weight", q, sid)
        load(layer, "weight_scale", s, sid)  # a scalar per shard, as vLLM's fp8 stores it
        load(layer, "input_scale", torch.tensor(in_scales[sid]), sid)
        dense.append(q.double() * s.double())
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.input_scale.item() == pytest.approx(0.02)  # the fused layer uses the largest
    x = torch.randn(4, 32, generator=g)
    xq = (x.double() / 0.02).clamp(-448, 448).to(FP8).double() * torch.tensor(0.02, dtype=torch.float32).double()
    torch.testing.assert_close(layer(x).double(), reference_linear(xq, torch.cat(dense)), rtol=1e-5, atol=1e-5)


def test_per_channel_dynamic_token():
    layer = ReplicatedLinear(32, 24, False, quant_config=Fp8LinearMethod(Fp8Scheme("dynamic_token"), "fp8"))
    poison(layer)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 32, generator=g) * torch.linspace(0.01, 10, 24)[:, None]
    q, s = fp8_math.quantize_per_row(w)
    load(layer, "weight", q)
    load(layer, "weight_scale", s[:, None])  # compressed-tensors stores [out, 1]
    x = torch.randn(6, 32, generator=g)
    torch.testing.assert_close(layer(x).double(), reference_linear(ref_quant_groups(x, 32), q.double() * s.double()[:, None]),
                               rtol=1e-5, atol=1e-5)


def test_tensor_parallel_block_slices():
    block = (16, 16)
    g = torch.Generator().manual_seed(4)
    w_col, w_row = torch.randn(64, 32, generator=g), torch.randn(32, 64, generator=g)
    (qc, sc), (qr, sr) = fp8_math.quantize_blocks(w_col, block), fp8_math.quantize_blocks(w_row, block)
    x = torch.randn(3, 32, generator=g)
    full_col = reference_linear(ref_quant_groups(x, 16), ref_block_dequant(qc, sc, block))
    h = torch.randn(3, 64, generator=g)
    partials = []
    for rank in (0, 1):
        scheme = Fp8LinearMethod(Fp8Scheme("dynamic_group", block, "weight_scale_inv"), "fp8")
        col = MergedColumnParallelLinear(32, [32, 32], tp_size=2, tp_rank=rank, quant_config=scheme)
        poison(col)
        for sid in (0, 1):
            load(col, "weight", qc[32 * sid:32 * (sid + 1)], sid)
            load(col, "weight_scale_inv", sc[2 * sid:2 * (sid + 1)], sid)
        want = torch.cat([full_col[:, 32 * sid + 16 * rank:32 * sid + 16 * (rank + 1)] for sid in (0, 1)], 1)
        torch.testing.assert_close(col(x).double(), want, rtol=1e-5, atol=1e-5)
        row = RowParallelLinear(64, 32, tp_size=2, tp_rank=rank, reduce_results=False,
                                quant_config=Fp8LinearMethod(Fp8Scheme("dynamic_group", block, "weight_scale_inv"), "fp8"))
        poison(row)
        load(row, "weight", qr)
        load(row, "weight_scale_inv", sr)
        partials.append(row(h[:, 32 * rank:32 * (rank + 1)]).double())
    full_row = reference_linear(ref_quant_groups(h, 16), ref_block_dequant(qr, sr, block))
    torch.testing.assert_close(partials[0] + partials[1], full_row, rtol=1e-5, atol=1e-5)


def test_a_stacked_shard_off_the_block_grid_is_an_error_naming_the_layer():
    from keel.quantization import QuantizationError

    with pytest.raises(QuantizationError, match="gate_up.*not all multiples of the weight block's 16 rows"):
        MergedColumnParallelLinear(32, [40, 40], prefix="m.gate_up", quant_config=Fp8LinearMethod(
            Fp8Scheme("dynamic_group", (16, 16), "weight_scale_inv"), "fp8"))


def test_a_float_weight_where_fp8_is_expected_is_an_error():
    layer = ReplicatedLinear(32, 16, False, prefix="m.proj", quant_config=Fp8LinearMethod(Fp8Scheme("dynamic_token"), "fp8"))
    with pytest.raises(WeightLoadError, match="m.proj.*dtype torch.float32.*needs torch.float8_e4m3fn"):
        load(layer, "weight", torch.randn(16, 32))
