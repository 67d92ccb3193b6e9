"""Act order served in the kernels' loads: with `perm`, every int4 Triton GEMM (the dot tile GEMM, the GEMV, the
folded GEMV, the tensor-core GEMM) reads activation column perm[k] for the weight's input k, and its output is
bit-equal to the same kernel run on the gathered activations x[:, perm] -- the launch `Int4LinearMethod.apply` no
longer makes before each act-order layer. Interpreted on the CPU (small shapes, masks off the tile grid and split
K included); compiled on a GPU."""

from __future__ import annotations

import pytest
import torch
from keel_quantization import int4_math
from keel_quantization.quantizer_int4 import int4_tensors
from keel_quantization.small_m_plan import SmallMPlan

pytest.importorskip("triton")
int4_triton = pytest.importorskip("keel_quantization.int4_triton")
mma = pytest.importorskip("keel_quantization.int4_mma_triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _layer(k: int, n: int, group: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tensors, _ = int4_tensors("gptq", "x.weight", torch.randn(n, k, generator=gen), group_size=group, sym=False,
                              desc_act=False, seed=seed)
    zeros = (int4_math.unpack_cols(tensors["x.qzeros"]) + 1).to(dtype)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    return (on(tensors["x.qweight"]), on(tensors["x.scales"].to(dtype)), on(zeros), on(tensors["x.g_idx"]),
            torch.randperm(k, generator=gen).to(DEVICE), gen)


@pytest.mark.parametrize("plan", [None, SmallMPlan("dot", 16, 16, 32, split_k=2), SmallMPlan("gemv", 2, 16, 32),
                                  SmallMPlan("gemv_fold", 1, 16, 32), SmallMPlan("gemv_fold", 2, 16, 64, split_k=2),
                                  SmallMPlan("gemv_fold", 4, 8, 16, split_k=3, num_stages=2)],
                         ids=["default", "dot-split2", "gemv", "fold", "fold-2groups-split2", "fold-prefetch-split3"])
@pytest.mark.parametrize("m,n", [(1, 40), (3, 32)])
def test_tile_and_gemv_kernels_read_the_permuted_columns(plan, m, n):
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    qw, s, z, g_idx, perm, gen = _layer(96, n, 32, dtype, seed=m + n)
    x = torch.randn(m, 96, generator=gen).to(dtype).to(DEVICE)
    got = int4_triton.int4_gemm(x, qw, s, z, g_idx, group_size=32, plan=plan, perm=perm)
    want = int4_triton.int4_gemm(x.index_select(1, perm), qw, s, z, g_idx, group_size=32, plan=plan)
    assert torch.equal(got, want)


@pytest.mark.parametrize("m", [1, 5])
def test_the_tensor_core_gemm_reads_the_permuted_columns(m):
    qw, s, z, _, perm, gen = _layer(256, 24, 128, torch.bfloat16, seed=m)
    x = torch.randn(m, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    tile = mma.MmaTile(block_n=16, block_m=16, block_k=128, num_warps=4, num_stages=1, split_k=2)
    got = mma.int4_mma_gemm(x, qw, s, z, 128, tile=tile, perm=perm)
    assert torch.equal(got, mma.int4_mma_gemm(x.index_select(1, perm), qw, s, z, 128, tile=tile))


def test_a_perm_of_the_wrong_length_is_refused():
    qw, s, z, g_idx, perm, _ = _layer(96, 16, 32, torch.float32, seed=0)
    x = torch.zeros(1, 96, device=DEVICE)
    with pytest.raises(ValueError, match="perm must be"):
        int4_triton.int4_gemm(x, qw, s, z, g_idx, group_size=32, perm=perm[:64])
