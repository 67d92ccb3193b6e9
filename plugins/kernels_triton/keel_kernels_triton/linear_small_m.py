"""Unquantized linear layers at decode sizes (M <= 8 rows) as a Triton GEMV, where a measured plan says so.

y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), 16-bit weights. A program owns BLOCK_N weight rows of one K
slice and every row of x (BLOCK_M >= M, a power of two; BLOCK_K = the plan's block_k / BLOCK_M, so the
accumulator's registers do not grow with M): each step loads a [BLOCK_N, BLOCK_K] weight tile
(contiguous along K: wide vector loads), widens it to float32 and multiply-adds it with the [BLOCK_M,
BLOCK_K] activations; the products sum over K once, after the loop (no cross-thread reduction per tile).
One K slice writes y in the weight's dtype, rounded once as F.linear rounds; more write float32 partials
that `moe_sum` adds in slice order (the bias rides in slice 0), so the result is float32 sums of exact
products in another order than cuBLAS's, rounded once.

Why: at one token a decode step's small GEMMs are launch- and ramp-bound under cuBLAS. On the H200
(h200-step-profile-dsv2lite-nopdl-2bcda9d.json) DeepSeek-V2-Lite's 2-12 MB projections ran at ~1.4 TB/s,
a third of copy bandwidth, and Llama-8B's split-K GEMMs (o_proj, down_proj) with their cuBLAS reduce at
~84% where its other GEMMs reach ~96%. Nothing runs this kernel until `benchmarks/h200_linear_small_m.py`
has measured it faster than cuBLAS for a shape on a device and written the plan (`LinearPlan`) into
`linear_configs/<device>.json` (or the folder named by KEEL_LINEAR_SMALL_M_CONFIG_DIR, searched first):
the `linear_small_m` op (ops.py) binds only into layers whose (N, K) has a plan there.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from keel_kernels_triton.fused_moe.moe_sum import moe_sum
from keel_kernels_triton.pdl import pdl_enter, pdl_kwargs
from keel_kernels_triton.support import interpreter_enabled

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "linear_configs"
CONFIG_DIR_ENV = "KEEL_LINEAR_SMALL_M_CONFIG_DIR"
MAX_M = 8  # rows the kernel takes at most (BLOCK_M <= 8: a 3-D accumulator of BLOCK_M x BLOCK_N x BLOCK_K)


@dataclass(frozen=True)
class LinearPlan:
    """How one (N, K) shape runs up to `max_m` rows: weight rows and inputs per program step, K slices."""

    max_m: int
    block_n: int
    block_k: int
    splits: int = 1
    num_warps: int = 4
    ahead: bool = False  # load each weight tile one K step ahead (registers): twice the bytes in flight

    def __post_init__(self) -> None:
        if not 1 <= self.max_m <= MAX_M:
            raise ValueError(f"linear plan max_m must be in 1..{MAX_M}, got {self.max_m}")
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"linear plan {name} must be a power of two, got {v}")
        if self.splits < 1 or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"linear plan needs splits >= 1 and num_warps a power of two <= 16, got {self}")


def device_file_name(device_name: str) -> str:
    return device_name.replace(" ", "_") + ".json"


@functools.cache
def load_plans(device_name: str, dtype_name: str) -> dict[tuple[int, int], LinearPlan]:
    """{(N, K): plan} for 16-bit weights of `dtype_name` on this device: the override folder first, then the
    package's. A file maps "bfloat16" / "float16" to {"N,K": {"max_m": .., "block_n": .., ...}}."""
    for folder in (os.environ.get(CONFIG_DIR_ENV), CONFIG_DIR):
        if not folder:
            continue
        path = Path(folder) / device_file_name(device_name)
        if path.exists():
            table = json.loads(path.read_text()).get(dtype_name, {})
            plans = {}
            for key, entry in table.items():
                n, k = (int(v) for v in key.split(","))
                plans[(n, k)] = LinearPlan(**entry)
            logger.info("linear_small_m: %d measured shapes for %s %s (%s)", len(plans), device_name, dtype_name,
                        path)
            return plans
    return {}


def _linear_gemv_kernel(
    x_ptr,  # [M, K] 16-bit, unit stride over K
    w_ptr,  # [N, K] 16-bit, unit stride over K
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N] in the weight's dtype; PARTIALS: [K slices, M, N] float32 partials
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTIALS: tl.constexpr, HAS_BIAS: tl.constexpr,  # PARTIALS: K is split (one compile for any count)
    PDL: tl.constexpr = False,
    AHEAD: tl.constexpr = False,  # the next K step's weight tile loads before this one's multiply-adds
):
    pdl_enter(PDL)
    # Reductions through tl.reduce with the standard combine (not tl.sum): see fused_moe/routing.py.
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    rows = tl.where(mask_n, offs_n, 0).to(tl.int64)
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    if AHEAD:  # the first tile; each step then loads the next before using this one (past k_end: masked, 0)
        nxt = tl.load(w_ptr + rows[:, None] * stride_wn + (k_start + offs_k)[None, :],
                      mask=mask_n[:, None] & (k_start + offs_k < k_end)[None, :], other=0.0)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < k_end
        if AHEAD:
            w = nxt.to(tl.float32)  # [BN, BK]
            kn = k + BLOCK_K
            nxt = tl.load(w_ptr + rows[:, None] * stride_wn + kn[None, :], mask=mask_n[:, None] & (kn < k_end)[None, :],
                          other=0.0)
        else:
            w = tl.load(w_ptr + rows[:, None] * stride_wn + k[None, :], mask=mask_n[:, None] & mask_k[None, :],
                        other=0.0).to(tl.float32)  # [BN, BK]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0).to(tl.float32)  # [BM, BK]
        if BLOCK_M == 1:
            acc += w * x  # [BN, BK] * [1, BK]
        else:
            acc += w[None, :, :] * x[:, None, :]
    if BLOCK_M == 1:
        y = tl.reshape(tl.reduce(acc, 1, tl.standard._sum_combine), (1, BLOCK_N))  # [1, BN]
    else:
        y = tl.reduce(acc, 2, tl.standard._sum_combine)  # [BM, BN]
    if HAS_BIAS:
        first = (offs_n * 0 + pid_s) == 0  # [BN]: the bias rides in K slice 0 only
        b = tl.load(bias_ptr + offs_n, mask=mask_n & first, other=0.0).to(tl.float32)
        y += b[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if not PARTIALS:
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        base = out_ptr + pid_s.to(tl.int64) * M * N
        tl.store(base + offs_m[:, None] * N + offs_n[None, :], y, mask=mask)


@functools.cache
def _jitted(interpret: bool) -> Any:
    del interpret  # part of the cache key only: triton.jit reads TRITON_INTERPRET itself
    return triton.jit(_linear_gemv_kernel, do_not_specialize=["M"])


def linear_small_m(
    x: torch.Tensor,  # [M, K], M <= plan.max_m, unit stride over K
    weight: torch.Tensor,  # [N, K] 16-bit, unit stride over K
    bias: torch.Tensor | None,  # [N] or None
    plan: LinearPlan,
) -> torch.Tensor:  # [M, N] in weight's dtype: F.linear(x, weight, bias)
    """The GEMV launch (and, with K slices, the slice sum); the caller checks Triton runs on x's device."""
    m, k = x.shape
    n = weight.shape[0]
    if m > plan.max_m or weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"linear_small_m needs x [<= {plan.max_m}, K] and weight [N, K] with unit strides over K, "
                         f"got {tuple(x.shape)} / {tuple(weight.shape)}")
    out = torch.empty(m, n, dtype=weight.dtype, device=x.device)
    if m == 0:
        return out
    k_per_split = triton.cdiv(triton.cdiv(k, plan.splits), plan.block_k) * plan.block_k
    splits = triton.cdiv(k, k_per_split)
    dest = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, plan.block_n), splits)
    block_m = max(1, triton.next_power_of_2(m))
    # BLOCK_M rows share the registers one row's [BLOCK_N, BLOCK_K] accumulator takes: K steps shrink with M
    block_k = max(16, plan.block_k // block_m)
    _jitted(interpreter_enabled())[grid](
        x, weight, bias if bias is not None else weight, dest, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=plan.block_n, BLOCK_K=block_k,
        PARTIALS=splits > 1, HAS_BIAS=bias is not None, num_warps=plan.num_warps, AHEAD=plan.ahead,
        **pdl_kwargs(dest),
    )
    if splits > 1:
        moe_sum(dest.unsqueeze(2), out)  # [splits, M, 1, N] -> [M, N], slice order, rounded once
    return out
