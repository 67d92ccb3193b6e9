"""How much of its weight a decode-size GEMM kernel asks L2 for before its programmatic-dependent-launch wait.

With PDL a kernel starts while the one before it finishes, and waits (`griddepcontrol.wait`) before touching
what that one writes. A model's weights are written by no kernel of a step, so the GEMV-shaped kernels of the
Triton plugins (the quantization plugin's fp8 / int4 decode GEMMs, kernels-triton's unquantized GEMV) prefetch
the start of their weight range into L2 before the wait: its DRAM reads run while the previous kernel ends.
Why: at batch 1 these GEMMs are latency-bound, with few bytes in flight (18-60% of DRAM bandwidth under
Nsight Compute on the H200, `h200-ncu-small-m-a6116cd.json`), and each one starts with a full DRAM round
trip after the wait. The prefetch itself (`prefetch_l2`, one PTX `prefetch.global.L2` a line) is Triton and
lives in each plugin's `pdl` module; the size rule is torch-free arithmetic shared here.
"""

from __future__ import annotations

# Weight bytes a program asks for before the wait: the start of its K range, all of it where the range is
# shorter (Llama-8B's fp8 W8A8 programs at batch 1 cover 64 rows x 1024 inputs: 64 KB).
WEIGHT_PREFETCH_BYTES = 64 << 10
# Programs (in launch order: program id 0 fastest) that prefetch: those that can be resident while the previous
# kernel runs. Later ones start after the wait has long returned, where a prefetch would only double their own
# loads' requests (a batch-1 gate_up GEMM has 1792 programs; an H200 holds a few per SM of 132).
WEIGHT_PREFETCH_PROGRAMS = 1024


def weight_prefetch_k(pdl: dict, k_per_split: int, bytes_per_input: float, granule: int) -> int:
    """The PREFETCH_K constexpr of a GEMV-shaped kernel launched with `pdl` (the plugin's pdl_kwargs result):
    inputs of its K range prefetched before the wait, a power of two and at least `granule` (inputs one
    prefetch covers along K: a 128-byte line of fp8, 64 16-bit inputs, a row of int4 words), covering the
    split's K where WEIGHT_PREFETCH_BYTES of the program's tile allow (`bytes_per_input`: the program's weight
    bytes per input of K); 0 without PDL, where there is nothing to overlap."""
    if not pdl:
        return 0
    budget = max(1, int(WEIGHT_PREFETCH_BYTES // bytes_per_input))  # inputs of K the budget covers
    whole = 1 << max(0, k_per_split - 1).bit_length()  # the split's K, up to a power of two
    return max(granule, min(whole, 1 << (budget.bit_length() - 1)))
