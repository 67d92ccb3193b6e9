"""How a weight-only GEMM (fp8 or int4) runs at decode sizes: which kernel, its tiles, its K split.

Decode GEMMs are memory-bound on the weight: what matters is enough programs in flight to cover every SM
with loads (132 on an H200), even when N / BLOCK_N is small (4096 outputs / 32 = 128 programs). Two
structures serve small M, each optionally split along K (fp32 partials per split, then one reduce launch
that sums them in a fixed order -- deterministic, and nothing to zero, so CUDA graphs capture both):
- "dot": the tensor-core GEMM (each weight tile widened / dequantized in registers, then tl.dot), any M.
- "gemv": no tensor cores; every M row (BLOCK_M >= M, a few) multiplies the widened tile in float32 and
  sums over K, so a program reads wide, contiguous weight rows and spends no MMA padding on M = 1.
- "gemv_fold" (int4 only): "gemv" with the zero point and the float conversion folded out of the inner
  loop (`int4_gemv_fold_triton`): a nibble extraction and one FMA per weight element.
- "dot_w8a8" (fp8 with quantized activations, `fp8_w8a8_small_m_triton`): fp8 x fp8 MMA with the weight
  rows as the MMA's M and the tokens (block_m, >= 16) as its N; activation quantization in the kernel.

`fp8_plan` / `int4_plan` / `w8a8_plan` are pure functions of the GEMM's shape (M, N, K, scale group): the
plan is fixed per CUDA-graph bucket (M is static there), never decided per step from data.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

KERNELS = ("dot", "gemv", "gemv_fold", "dot_w8a8")


@dataclass(frozen=True)
class SmallMPlan:
    kernel: str  # "dot" | "gemv" | "gemv_fold" (int4 only) | "dot_w8a8" (W8A8 fp8 only)
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1  # K splits requested (fewer where K has fewer BLOCK_K tiles)
    num_warps: int = 4
    num_stages: int | None = None  # pipeline depth: the launch's for "dot", tl.range's for "gemv" / "gemv_fold"

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"SmallMPlan: kernel {self.kernel!r} is not one of {KERNELS}")
        if self.split_k < 1 or min(self.block_m, self.block_n, self.block_k) < 1:
            raise ValueError(f"SmallMPlan: tiles and split_k must be >= 1: {self}")

    def fits_groups(self, group: int) -> bool:
        """Whether this plan's K tiles fit scale groups of `group` inputs (0: one group over K, or gathered):
        a tile lies in one group, or -- gemv_fold only -- holds whole ones (scale and zero per word row)."""
        return (group == 0 or group % self.block_k == 0
                or (self.kernel == "gemv_fold" and self.block_k % group == 0))

    def launch_options(self) -> dict:
        """Triton launch options (num_warps, num_stages where set)."""
        return {"num_warps": self.num_warps, **({} if self.num_stages is None else {"num_stages": self.num_stages})}


def _dot(bm: int, bn: int, split: int, stages: int | None = 4) -> SmallMPlan:
    return SmallMPlan("dot", bm, bn, 128, split, num_stages=stages)


# family -> ((largest M, plan), ...) ascending: the measured plan of each M bucket (benchmarks/
# h200_quant_small_m.py's best_per_bucket: least total time over Llama-8B's qkv / o / gate_up / down);
# an M past the last bucket, or a family not here, takes the built-in default below; None: the default
# won that bucket. Families: "fp8_row" (one scale group over K), "fp8_block", "int4"; "fp8_row_w8a8" /
# "fp8_block_w8a8": the W8A8 small-M GEMM (fp8 layers with activation scales), whose last bucket is also
# the largest M it serves (`w8a8_max_m`): past it the large-M W8A8 path (a quantization launch, then
# cuBLAS) is faster.
# H200 at ee79a05 (benchmarks/results/h200-quant-small-m-ee79a05.json), us per four layers, default -> plan:
# fp8_row M=1 113.6 -> 86.1 (gemv), M=2 114.3 -> 106.7; fp8_block M=1 128.8 -> 97.9, M 2-16 ~127 -> ~107,
# M=32 218 -> 130; int4 M 1-16 246 -> 140-143, M=32 272 -> 180, M=64 348 -> 192. fp8_row M 4-64 were cut
# by the sweep's budget on down_proj: they take the plans fp8_block measured (same kernel, K tiles of 128)
# and fp8_row's own on the other three layers (qkv / o / gate_up: dot 16x64x128 s4 within 3% of the best).
# At 0b338b1 (h200-quant-small-m-0b338b1.json): fp8_row's gemv with the scale after the loop M=1 80.4
# (86.1 before); int4's gemv_fold M=1 137.9 -> 70.5 (floor 25.9), M=2 139.8 -> 92.7, M >= 4 no better
# than the dot rows. The gemv_fold rows serve scale groups in order only: with a gathered g_idx the
# kernel runs its unfolded math, unmeasured against dot, so those GEMMs take the default.
# fp8_row M=1 pipelined (1x8x512, num_stages 3: tl.range copies two tiles ahead) measured faster on an H100 at
# 83ecae0 (h100-quant-small-m-pipelined-83ecae0.json; no H200 came): 92.5 -> 85.2 us over four layers, every layer
# (down 28.3 -> 23.6). Not in the table yet: the pipelined loop has run only interpreted and in that timing sweep,
# never against its reference compiled (tests/test_cuda_quant.py on a GPU). Pipelined gemv_fold (int4) and W8A8
# GEMV lost on every layer there.
TABLES: dict[str, tuple[tuple[int, SmallMPlan | None], ...]] = {
    "fp8_row": ((1, SmallMPlan("gemv", 1, 8, 512)), (16, _dot(16, 64, 4)), (32, _dot(32, 64, 4)),
                (64, _dot(64, 64, 4))),
    "fp8_block": ((1, SmallMPlan("gemv", 1, 32, 128, 4)), (8, _dot(16, 64, 4)), (16, _dot(16, 32, 4)),
                  (32, _dot(32, 64, 4)), (64, _dot(64, 64, 4))),
    "int4": ((1, SmallMPlan("gemv_fold", 1, 16, 1024)), (2, SmallMPlan("gemv_fold", 2, 32, 512, 2)),
             (16, _dot(16, 64, 8, None)), (32, _dot(32, 64, 4, None)), (64, _dot(64, 64, 4, None))),
    "fp8_row_w8a8": ((1, SmallMPlan("dot_w8a8", 16, 64, 256, 4, num_stages=4)), (8, None)),
    "fp8_block_w8a8": ((1, SmallMPlan("dot_w8a8", 16, 64, 128, 8, num_stages=4)),
                       (4, SmallMPlan("dot_w8a8", 16, 128, 128, 8, num_stages=4)),
                       (16, SmallMPlan("dot_w8a8", 16, 128, 128, 8, num_warps=8, num_stages=4))),
}
# W8A8 at e73eee6 (h200-quant-small-m-w8a8-e73eee6.json, activations per token / per token and group, us per
# four layers; the weight-only rows above, then the large-M W8A8 path): fp8_row_w8a8 M=1 90.4 (weight-only
# 80.4, W8A8 143), M=2-8 92-115 (104-105, 137-143), M=16 190 (104, 136): its tiles then had no 8-warp one;
# fp8_block_w8a8 M=1 103 (98, 138), M=2-4 97-101 (~107, 138), M=8-16 115-120 (~107, 139), M=32 166 (130,
# 154). The W8A8 small-M GEMM multiplies the activations the large-M path does (a request's tokens do
# not depend on its step's batch size); the weight-only GEMM it replaces multiplied unquantized ones.
SHIPPED = dict(TABLES)

# (family, N, K, the bucket's largest M) -> plan: one layer shape's own plan in a bucket, where the sweep
# measured it at least LAYER_MARGIN faster on that shape than the bucket's plan (benchmarks/
# h200_quant_small_m.py's "layers"; least total time over four layers leaves each layer a compromise).
# It overrides the bucket's row for that shape only; other shapes (other models) take the row.
# H200 at 0b338b1 (h200-quant-small-m-0b338b1.json; the gemv_fold kernel has since gained only its PDL
# entry), us a layer, the bucket's plan as the engine ran it -> the layer's: int4 M=1 down (K 14336,
# FOLD_MAX_K_PER_SPLIT splits the row's plan in 2) 20.1 -> 18.5; M=2 qkv 13.0 -> 12.0, gate_up 44.5 -> 41.7.
# Predicted: GPTQ Llama-8B's batch-1 decode step -0.05 ms (of 2.96 on the H200), batch 2 -0.1 ms.
# int4 M=1 qkv (6144 x 4096): 1x32x1024, 8 warps, split 2 ran 9.3 / 9.4 us against the row's 12.3 / 11.9 in two
# H100 sweeps at 83ecae0 (h100-quant-small-m-pipelined-83ecae0.json); H200 unmeasured. Predicted: the batch-1 GPTQ
# step -0.09 ms (32 layers x ~2.8 us).
LAYER_MARGIN = 0.03
LayerPlans = dict[tuple[str, int, int, int], SmallMPlan]
LAYER_PLANS: LayerPlans = {
    ("int4", 4096, 14336, 1): SmallMPlan("gemv_fold", 1, 32, 1024, 4, num_warps=8),
    ("int4", 6144, 4096, 1): SmallMPlan("gemv_fold", 1, 32, 1024, 2, num_warps=8),
    ("int4", 6144, 4096, 2): SmallMPlan("gemv_fold", 2, 16, 1024),
    ("int4", 28672, 4096, 2): SmallMPlan("gemv_fold", 2, 32, 512),
}
SHIPPED_LAYERS = dict(LAYER_PLANS)


def use_tables(tables: dict[str, tuple[tuple[int, SmallMPlan | None], ...]], layers: LayerPlans | None = None
               ) -> None:
    """Replace the measured tables and the per-layer plans (none unless given) -- benchmarks try a sweep's
    plans in the engine, tests pin theirs; called before any layer runs: plans are cached per shape."""
    TABLES.clear()
    TABLES.update({f: tuple(sorted(rows, key=lambda r: r[0])) for f, rows in tables.items()})
    LAYER_PLANS.clear()
    LAYER_PLANS.update(layers or {})
    fp8_plan.cache_clear()
    int4_plan.cache_clear()
    w8a8_plan.cache_clear()


def use_shipped() -> None:
    """The committed tables and per-layer plans again (after a test or benchmark replaced them)."""
    use_tables(SHIPPED, SHIPPED_LAYERS)


def _bucket(family: str, m: int) -> tuple[int, SmallMPlan | None] | None:
    return next(((max_m, plan) for max_m, plan in TABLES.get(family, ()) if m <= max_m), None)


def _layer(family: str, m: int, n: int, k: int, group: int) -> SmallMPlan | None:
    """The plan measured for this layer shape in m's bucket (None: the bucket's row decides)."""
    bucket = _bucket(family, m)
    plan = None if bucket is None else LAYER_PLANS.get((family, n, k, bucket[0]))
    return plan if plan is not None and plan.fits_groups(group) else None


def _measured(family: str, m: int, group: int) -> SmallMPlan | None:
    bucket = _bucket(family, m)
    if bucket is None or bucket[1] is None:
        return None
    return bucket[1] if bucket[1].fits_groups(group) else None


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


@functools.cache
def fp8_plan(m: int, n: int, k: int, group_k: int) -> SmallMPlan:
    """The weight-only fp8 GEMM's plan for x [m, k] @ w[n, k]^T with scale groups of group_k inputs."""
    family, group = ("fp8_row", 0) if group_k >= k else ("fp8_block", group_k)
    measured = _layer(family, m, n, k, group) or _measured(family, m, group)
    if measured is not None:
        return measured
    if m > 64:  # weight-only checkpoints at prefill sizes: compute-bound, wide tiles
        return SmallMPlan("dot", 64, 128, 128 if group_k >= k else min(128, group_k), num_stages=4)
    # memory-bound: 32 weight rows a program (Llama-8B's 4096-row layers: 128 programs for 132 SMs)
    return SmallMPlan("dot", _block_m(m), 32, 256 if group_k >= k else min(256, group_k), num_stages=4)


# A gemv_fold program covers at most this many inputs: the tables are measured on Llama-8B's layers, whose
# longest K (down_proj, 14336) at M = 1 ran 22.6 us unsplit and 20.1 split in 2 (the table's 1x16x1024 plan;
# h200-quant-small-m-0b338b1.json); at K = 4096 a split only added its reduce (7.9 -> 8.3 us on o_proj), and
# at M = 2 the table's split 2 (7168 inputs a program) beat split 4 (25.0 vs 25.5).
FOLD_MAX_K_PER_SPLIT = 8192


@functools.cache
def int4_plan(m: int, n: int, k: int, group: int) -> SmallMPlan:
    """The int4 GEMM's plan for x [m, k] with `group` > 0 inputs per scale row in order (0: gathered)."""
    layer = _layer("int4", m, n, k, group if group < k else 0)
    if layer is not None and not (layer.kernel == "gemv_fold" and group == 0):
        return layer  # measured on this shape: its split as measured
    measured = _measured("int4", m, group if group < k else 0)
    if measured is not None and not (measured.kernel == "gemv_fold" and group == 0):
        if measured.kernel == "gemv_fold" and -(-k // measured.split_k) > FOLD_MAX_K_PER_SPLIT:
            return replace(measured, split_k=-(-k // FOLD_MAX_K_PER_SPLIT))
        return measured
    block_n = 32 if m <= 32 else 64  # small M: 128 programs for a 4096-output layer
    return SmallMPlan("dot", _block_m(m), block_n, 128 if group == 0 else min(128, group))


# The plans are pure functions of the shape, so the SM count is the H200's (132), not the device's.
SMS = 132


def w8a8_max_m(per_row: bool) -> int:
    """The largest M (tokens in a step) the W8A8 small-M GEMM serves, per row (one scale group over K) or
    per block: its table's last bucket (0: no table, never)."""
    rows = TABLES.get("fp8_row_w8a8" if per_row else "fp8_block_w8a8", ())
    return rows[-1][0] if rows else 0


@functools.cache
def w8a8_plan(m: int, n: int, k: int, group_k: int) -> SmallMPlan:
    """The W8A8 small-M GEMM's plan for x [m, k] (quantized in the kernel) @ w[n, k]^T, scale groups of group_k."""
    family, group = ("fp8_row_w8a8", 0) if group_k >= k else ("fp8_block_w8a8", group_k)
    measured = _layer(family, m, n, k, group) or _measured(family, m, group)
    if measured is not None:
        return measured
    block_m, block_n = 16 if m <= 16 else 32, 64
    block_k = 128 if group_k >= k else min(128, group_k)
    programs = -(-n // block_n) * -(-m // block_m)
    # ~2 programs per SM (4096 rows: 64 programs, split 4), each split at least 4 K tiles
    split = max(1, min(round(2 * SMS / programs), -(-k // block_k) // 4))
    return SmallMPlan("dot_w8a8", block_m, block_n, block_k, split, num_stages=4)
