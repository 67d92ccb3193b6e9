"""4-bit layers (GPTQ, AWQ) against a float64 reference: packing orders, zero offsets, g_idx groups in
activation order, fused shards, tensor-parallel slices; the Triton GEMM (dequantizing inside the
kernel) against the same reference on fresh inputs, odd sizes and a poisoned output buffer."""

from __future__ import annotations

import pytest
import torch
from keel_quantization import int4_math
from keel_quantization.int4_linear import Int4Format, Int4LinearMethod, tileable_group
from keel_quantization.quantizer_int4 import int4_tensors
from quant_test_utils import reference_linear

from keel.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from keel.quantization import QuantizationError

GPTQ = Int4Format("gptq", 32, zero_offset=1)
GPTQ_ACT = Int4Format("gptq", 32, zero_offset=1, desc_act=True)
AWQ = Int4Format("awq", 32)


def load_all(layer, tensors: dict, shard=None):
    params = dict(layer.named_parameters())
    for name, t in tensors.items():
        p = params[name.rsplit(".", 1)[-1]]
        p.weight_loader(p, t) if shard is None else p.weight_loader(p, t, shard)


def quantized(fmt, w, seed=0):
    return int4_tensors(fmt.method, "x.weight", w, group_size=fmt.group_size, sym=False, desc_act=fmt.desc_act,
                        seed=seed)


def ref_dequant_gptq(t):
    """Independent float64 decode of the GPTQ v1 tensors (bit loops, zero stored minus one)."""
    qw, qz, sc, gi = t["x.qweight"], t["x.qzeros"], t["x.scales"].double(), t["x.g_idx"].long()
    k, n = qw.shape[0] * 8, qw.shape[1]
    w = torch.empty(k, n, dtype=torch.float64)
    for kk in range(k):
        q = (qw[kk // 8] >> (4 * (kk % 8))) & 0xF
        z = torch.stack([(qz[gi[kk], c // 8] >> (4 * (c % 8))) & 0xF for c in range(n)]) + 1
        w[kk] = (q.double() - z.double()) * sc[gi[kk]]
    return w.T


@pytest.mark.parametrize("fmt", [GPTQ, GPTQ_ACT, AWQ], ids=["gptq", "gptq-desc-act", "awq"])
def test_fused_qkv_int4_matches_dequantized(fmt):
    layer = QKVParallelLinear(64, 16, 4, 2, quant_config=Int4LinearMethod(fmt, backend="torch"))
    g = torch.Generator().manual_seed(0)
    dense = []
    for i, sid in enumerate(("q", "k", "v")):
        w = torch.randn(64 if sid == "q" else 32, 64, generator=g) * (1 + i)
        # Shards of one fused layer share their input order (the same activations calibrate them).
        tensors, deq = quantized(fmt, w, seed=7)
        load_all(layer, tensors, sid)
        dense.append(deq)
        if fmt.method == "gptq" and i == 0:
            torch.testing.assert_close(deq.double(), ref_dequant_gptq(tensors))
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(5, 64, generator=g)
    torch.testing.assert_close(layer(x).double(), reference_linear(x, torch.cat(dense)), rtol=1e-5, atol=1e-5)


def test_awq_order_is_the_interleaved_one():
    v = torch.randint(0, 16, (4, 16))
    packed = int4_math.pack_cols(v, int4_math.AWQ_ORDER)
    for nibble, col in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
        assert torch.equal((packed[:, 0] >> (4 * nibble)) & 0xF, v[:, col])
    assert torch.equal(int4_math.unpack_cols(packed, int4_math.AWQ_ORDER), v)


def test_tensor_parallel_int4_slices():
    g = torch.Generator().manual_seed(1)
    w_col, w_row = torch.randn(64, 64, generator=g), torch.randn(32, 64, generator=g)
    (tc, dc), (tr, dr) = quantized(GPTQ, w_col), quantized(GPTQ, w_row)
    x = torch.randn(3, 64, generator=g)
    full_col, full_row = reference_linear(x, dc), reference_linear(x, dr)
    partial = []
    for rank in (0, 1):
        col = MergedColumnParallelLinear(64, [32, 32], tp_size=2, tp_rank=rank,
                                         quant_config=Int4LinearMethod(GPTQ, backend="torch"))
        for sid in (0, 1):
            load_all(col, {k: (v[:, 32 * sid:32 * (sid + 1)] if k.endswith(("qweight", "scales")) else
                               v[:, 4 * sid:4 * (sid + 1)] if k.endswith("qzeros") else v) for k, v in tc.items()}, sid)
        col.quant_method.process_weights_after_loading(col)
        want = torch.cat([full_col[:, 32 * s + 16 * rank:32 * s + 16 * (rank + 1)] for s in (0, 1)], 1)
        torch.testing.assert_close(col(x).double(), want, rtol=1e-5, atol=1e-5)
        row = RowParallelLinear(64, 32, tp_size=2, tp_rank=rank, reduce_results=False,
                                quant_config=Int4LinearMethod(GPTQ, backend="torch"))
        load_all(row, tr)
        row.quant_method.process_weights_after_loading(row)
        partial.append(row(x[:, 32 * rank:32 * (rank + 1)]).double())
    torch.testing.assert_close(partial[0] + partial[1], full_row, rtol=1e-5, atol=1e-5)


def test_layers_off_the_packing_grid_are_errors_naming_them():
    with pytest.raises(QuantizationError, match="m.proj has output slices \\(12,\\)"):
        ReplicatedLinear(64, 12, False, prefix="m.proj", quant_config=Int4LinearMethod(GPTQ))
    with pytest.raises(QuantizationError, match="desc_act checkpoints cannot split"):
        RowParallelLinear(64, 32, tp_size=2, prefix="m.down", quant_config=Int4LinearMethod(GPTQ_ACT))


def test_shards_with_different_input_orders_are_an_error():
    layer = MergedColumnParallelLinear(64, [32, 32], prefix="m.gate_up",
                                       quant_config=Int4LinearMethod(GPTQ_ACT, backend="torch"))
    g = torch.Generator().manual_seed(2)
    for sid in (0, 1):
        load_all(layer, quantized(GPTQ_ACT, torch.randn(32, 64, generator=g), seed=sid)[0], sid)
    with pytest.raises(QuantizationError, match="m.gate_up have different g_idx"):
        layer.quant_method.process_weights_after_loading(layer)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m,k,n,group,desc_act", [(1, 64, 64, 32, False), (5, 96, 40, 32, True),
                                                 (33, 128, 72, 64, False), (17, 64, 24, -1, True)])
def test_triton_int4_gemm_matches_reference(m, k, n, group, desc_act):
    pytest.importorskip("triton")
    from keel_quantization.int4_triton import int4_gemm

    g = torch.Generator().manual_seed(m * 1000 + k + n)
    fmt = Int4Format("gptq", group, zero_offset=1, desc_act=desc_act)
    tensors, deq = quantized(fmt, torch.randn(n, k, generator=g))
    zeros = (int4_math.unpack_cols(tensors["x.qzeros"]) + 1).float()
    x = torch.randn(m, k, generator=g)
    args = [t.to(DEVICE) for t in (x, tensors["x.qweight"], tensors["x.scales"].float(), zeros, tensors["x.g_idx"])]
    got = int4_gemm(*args)
    torch.testing.assert_close(got.double().cpu(), reference_linear(x, deq), rtol=1e-4, atol=1e-4)
    poisoned = torch.full((m, n), float("nan"), device=DEVICE)
    torch.testing.assert_close(int4_gemm(*args, out=poisoned), got)  # every element written
    in_order = tileable_group(args[4], k if group == -1 else group)
    assert bool(in_order) == (not desc_act or group == -1)  # desc_act's shuffled g_idx: gathered per input
    if in_order:  # one scale row per K tile, with tiles smaller than a group too
        for tiles in (None, (16, 16, 16)):
            poisoned = torch.full((m, n), float("nan"), device=DEVICE)
            grouped = int4_gemm(*args, out=poisoned, group_size=in_order, tiles=tiles)
            torch.testing.assert_close(grouped.double().cpu(), reference_linear(x, deq), rtol=1e-4, atol=1e-4)


def test_groups_the_gemm_cannot_tile_by_are_gathered():
    assert tileable_group(torch.arange(96, dtype=torch.int32) // 48, 48) == 0  # not a power of two
    assert tileable_group(torch.arange(96, dtype=torch.int32) // 32, 32) == 32
    assert tileable_group(torch.zeros(40, dtype=torch.int32), 40) == 40  # one group: any K


def test_int4_method_runs_the_kernel_when_asked():
    pytest.importorskip("triton")
    layer = ReplicatedLinear(64, 32, True, quant_config=Int4LinearMethod(AWQ, backend="triton"))
    g = torch.Generator().manual_seed(3)
    tensors, deq = quantized(AWQ, torch.randn(32, 64, generator=g))
    load_all(layer, tensors)
    layer.bias.data.copy_(torch.randn(32, generator=g))
    layer.quant_method.process_weights_after_loading(layer)
    layer.to(DEVICE)
    x = torch.randn(4, 64, generator=g)
    got = layer(x.to(DEVICE))
    assert layer.quant_method.last_backend == "triton" and layer.quant_method.group_in_order == AWQ.group_size
    torch.testing.assert_close(got.double().cpu(), reference_linear(x, deq, layer.bias.cpu()), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_act_order_is_put_in_group_order_once(backend):
    """desc_act: the inputs are permuted into group order after loading (qweight's rows with them, the activations
    gathered by the same permutation each forward), so the in-order kernels serve it; the outputs and the
    weight a layer reads back (`dequantize_weight`, checkpoint order) are the act-order layer's."""
    if backend == "triton":
        pytest.importorskip("triton")
    layer = ReplicatedLinear(96, 40, True, quant_config=Int4LinearMethod(GPTQ_ACT, backend=backend))
    g = torch.Generator().manual_seed(11)
    tensors, deq = quantized(GPTQ_ACT, torch.randn(40, 96, generator=g))
    assert not tileable_group(tensors["x.g_idx"], 32)  # shuffled groups
    load_all(layer, tensors)
    layer.bias.data.copy_(torch.randn(40, generator=g))
    layer.quant_method.process_weights_after_loading(layer)
    perm = layer.input_perm
    assert layer.quant_method.group_in_order == 32 and sorted(perm.tolist()) == list(range(96))
    assert torch.equal(layer.g_idx, torch.arange(96, dtype=torch.int32) // 32)
    torch.testing.assert_close(layer.quant_method.dequantize_weight(layer).double(), deq.double(), rtol=0, atol=0)
    layer.to(DEVICE)
    for m in (1, 5):
        x = torch.randn(m, 96, generator=g)
        got = layer(x.to(DEVICE))
        assert layer.quant_method.last_backend == backend
        torch.testing.assert_close(got.double().cpu(), reference_linear(x, deq, layer.bias.cpu()), rtol=1e-4,
                                   atol=1e-4)


def test_act_order_with_uneven_groups_keeps_the_gathered_path():
    """A g_idx whose groups are not all `group` inputs (nothing a permutation puts on the 32-input grid) is
    served gathered, unpermuted."""
    layer = ReplicatedLinear(64, 16, False, quant_config=Int4LinearMethod(GPTQ_ACT, backend="torch"))
    g = torch.Generator().manual_seed(12)
    tensors, deq = quantized(GPTQ_ACT, torch.randn(16, 64, generator=g))
    g_idx = torch.tensor([0] * 40 + [1] * 24, dtype=torch.int32)[torch.randperm(64, generator=g)]
    tensors["x.g_idx"] = g_idx
    load_all(layer, tensors)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.quant_method.group_in_order == 0 and layer.input_perm is None


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_down_proj_act_order_folds_into_gate_up(backend):
    """A declared input source (`set_input_source`: down reads act(gate) * up per index) takes the consumer's
    act-order permutation into the producer's outputs, both halves and the bias alike: down no longer gathers its
    activations, and the MLP's output is the same."""
    if backend == "triton":
        pytest.importorskip("triton")
    from torch import nn

    from keel.layers.linear import fold_input_permutations

    gate_up = MergedColumnParallelLinear(64, [64, 64], True, quant_config=Int4LinearMethod(GPTQ_ACT, backend=backend))
    down = RowParallelLinear(64, 48, False, quant_config=Int4LinearMethod(GPTQ_ACT, backend=backend))
    down.set_input_source(gate_up, parts=2)
    g = torch.Generator().manual_seed(3)
    for shard in (0, 1):  # one input order for both halves, as GPTQ's act order gives them
        load_all(gate_up, quantized(GPTQ_ACT, torch.randn(64, 64, generator=g), seed=5)[0], shard)
    load_all(down, quantized(GPTQ_ACT, torch.randn(48, 64, generator=g), seed=6)[0])
    gate_up.bias.data.copy_(torch.randn(128, generator=g))
    for layer in (gate_up, down):
        layer.quant_method.process_weights_after_loading(layer)
    mlp = nn.ModuleList([gate_up, down]).to(DEVICE)

    def forward(x):
        y = gate_up(x)
        return down(torch.nn.functional.silu(y[:, :64]) * y[:, 64:])

    x = torch.randn(3, 64, generator=g).to(DEVICE)
    before = forward(x)
    assert down.input_perm is not None and gate_up.input_perm is not None
    assert fold_input_permutations(mlp) == 1
    assert down.input_perm is None and gate_up.input_perm is not None  # gate_up's own input keeps its gather
    torch.testing.assert_close(forward(x), before, rtol=1e-6, atol=1e-6)
    assert fold_input_permutations(mlp) == 0  # once
