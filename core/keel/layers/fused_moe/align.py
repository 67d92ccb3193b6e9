"""The reference `moe_align_block_size` in torch ops: the layout a grouped-GEMM MoE kernel runs on.

Kernel plugins (e.g. kernels-triton's fused experts) call it for steps their own alignment kernel does not
take, and test their kernel against it; the core's torch experts path does not need it.
"""

from __future__ import annotations

import torch


def moe_align_block_size_torch(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids [max_padded] int32, expert_ids [max_padded // block_m] int32, total [1] int32).

    sorted_token_ids lists flat (token * top_k + slot) indices grouped by expert (ascending within an
    expert), each expert's run padded with the sentinel num_tokens * top_k to a multiple of block_m;
    expert_ids[b] is the expert of block b. Entries past `total` are sentinels (rows) and 0 (experts).
    max_padded = num_pairs + num_experts * (block_m - 1), rounded up to block_m: known from shapes alone.
    """
    flat = topk_ids.reshape(-1).long()
    num_valid = flat.numel()
    device = flat.device
    max_padded = num_valid + num_experts * (block_m - 1)
    max_padded = -(-max_padded // block_m) * block_m
    # No host sync anywhere (CUDA-graph capturable): counts by scatter-add, not bincount (which reads the
    # max id back); block -> expert by searchsorted, not repeat_interleave (data-dependent output size).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)  # [E]
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # flat indices grouped by expert
    experts_sorted = flat[order]
    rank = torch.arange(num_valid, device=device) - count_start[experts_sorted]
    sorted_ids = torch.full((max_padded,), num_valid, dtype=torch.int32, device=device)
    sorted_ids[padded_start[experts_sorted] + rank] = order.to(torch.int32)
    block_starts = torch.arange(max_padded // block_m, device=device) * block_m
    owner = torch.searchsorted(padded_end, block_starts, right=True)  # [max_blocks]
    # Blocks past the real ones (owner == E) do no work; they read expert 0.
    expert_ids = torch.where(owner < num_experts, owner, 0).to(torch.int32)
    total = padded.sum().reshape(1).to(torch.int32)
    return sorted_ids, expert_ids, total
