"""Act order's activation gather, y[:, j] = x[:, perm[j]], as a Triton kernel that takes part in programmatic
dependent launch (PDL) like the int4 GEMMs around it.

Why: an act-order (desc_act) GPTQ layer, permuted into group order after loading (`int4_linear`), gathers its
activations' columns before every GEMM. As `torch.index_select` that is a launch outside the PDL chain: the int4
GEMM after it can no longer start during its predecessor, and keel's act-order checkpoint ran batch 1 at 3.90 ms
against 2.99 in order on the H100 (128 gathers a step, ~7 us each; `h100-vs-vllm-3adf255.json`). Reading the
columns through the permutation inside the GEMMs' loads was 8.7x slower (`h100-keel-gptq-act-ckpt-28a78bf.json`),
so the gather stays its own pass, made cheap: each program writes BLOCK_N contiguous columns of one row of y and
reads that row of x at the permuted columns (a row is K contiguous elements: the reads stay in a few cache lines).
Prediction: ~2-3 us a gather in the graph, batch 1 3.90 -> ~3.4 ms. Measured together with down_proj's gather
folded into gate_up's outputs (H100, `h100-keel-gptq-act-ckpt-a551b54.json`): batch 1 3.15 ms (in order 3.01),
throughput 11.7k -> 12.2k out tok/s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from keel_quantization.pdl import pdl_enter, pdl_kwargs


@triton.jit(do_not_specialize=["M"])  # one variant for every step size: graphs and eager steps run what warm-up built
def _gather_columns_kernel(x_ptr, perm_ptr, y_ptr, M, K, stride_xm, stride_ym, BLOCK_N: tl.constexpr,
                           PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0)  # rows on grid axis 0, which takes any step size (axis 1 stops at 65535)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
    mask = offs_n < K
    cols = tl.load(perm_ptr + offs_n, mask=mask, other=0)  # [BN] input columns
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask)  # [BN]
    tl.store(y_ptr + row * stride_ym + offs_n, x, mask=mask)


def gather_columns(
    x: torch.Tensor,  # [M, K], unit stride over K
    perm: torch.Tensor,  # [K] int32 / int64 on x's device: a permutation of 0..K-1
) -> torch.Tensor:  # [M, K] contiguous: x[:, perm]
    m, k = x.shape
    if perm.shape != (k,) or perm.device != x.device or x.stride(1) != 1:
        raise ValueError(f"gather_columns: x {tuple(x.shape)} (unit stride over K) on {x.device} needs perm [{k}] "
                         f"there, got {tuple(perm.shape)} on {perm.device}")
    y = torch.empty(m, k, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_n = min(1024, triton.next_power_of_2(k))  # fixed per layer: one compiled variant per K
    _gather_columns_kernel[(m, triton.cdiv(k, block_n))](x, perm, y, m, k, x.stride(0), y.stride(0),
                                                         BLOCK_N=block_n, **pdl_kwargs(x))
    return y
