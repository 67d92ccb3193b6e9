"""Per-step metadata of triton_flash, built once per step and shared by every layer.

A uniform step -- every request has the same number q <= MAX_UNIFORM_QUERY_LEN of new tokens: pure
decode (q = 1) or speculative verification (q = 1 + drafts) -- runs the split-K decode kernels with q
query rows per request. Its metadata needs nothing beyond the common metadata's device tensors and its
launch grids depend only on (num_reqs, q, max_seq_len), so the metadata stays valid when the runner
refills those tensors in place: that is what lets the model runner capture such steps as CUDA graphs.
Other steps get a query-tile table (which request, which first query row) built on the CPU from
`query_start_loc_cpu`, per tile height.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from keel.attention.metadata import CommonAttentionMetadata
from keel.worker.staging import host_to_device

# Largest uniform query length the split-K kernels take (rows = q x heads per KV head stay in registers).
MAX_UNIFORM_QUERY_LEN = 8


def uniform_query_len(common: CommonAttentionMetadata, limit: int) -> int:
    """q when every request of the step has exactly q <= `limit` new tokens, else 0. Reads only CPU
    tensors (no device sync): the query lengths are at most max_query_len and sum to num_reqs * q
    exactly when all of them equal q."""
    n, q = common.num_reqs, common.max_query_len
    if n == 0 or not 1 <= q <= limit:
        return 0
    return q if int(common.query_start_loc_cpu[n]) == n * q else 0


def query_tiles(common: CommonAttentionMetadata, reqs: np.ndarray,
                block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([num_tiles] int32 request, [num_tiles] int32 first query row) on the device: the `block_q`-row query
    tiles of requests `reqs` (CPU indices, ascending), from `query_start_loc_cpu`.

    numpy, not torch CPU ops: the first layer's forward calls this with the device waiting on it, and torch's
    CPU repeat_interleave / cumsum took ~25 ms there on an H100 host (64-prompt DSV2-Lite prefill step: wall
    124 -> 98 ms, CPU time 478 -> 98 ms once numpy; h100-step-profile-host-dsv2lite-*.json); numpy ~0.1 ms."""
    qsl = common.query_start_loc_cpu.numpy().astype(np.int64)
    per_req = (qsl[reqs + 1] - qsl[reqs] + block_q - 1) // block_q  # query tiles of each request
    tile_req = np.repeat(reqs, per_req)
    first_tile = np.cumsum(per_req) - per_req
    tile_q0 = (np.arange(int(per_req.sum())) - np.repeat(first_tile, per_req)) * block_q
    device = common.query_start_loc.device
    return (host_to_device(torch.from_numpy(tile_req.astype(np.int32)), device),
            host_to_device(torch.from_numpy(tile_q0.astype(np.int32)), device))


@dataclass
class FlashAttentionMetadata:
    """What `TritonFlashAttentionImpl.forward` reads; one object per step."""

    common: CommonAttentionMetadata
    is_decode: bool  # every request has exactly `query_len` new tokens: the split-K decode kernels run
    num_reqs: int
    num_actual_tokens: int  # tokens whose K/V are written (padding rows carry slot -1)
    num_query_rows: int  # rows with an output of a real request (query_start_loc[-1])
    max_seq_len: int  # an upper bound of seq_lens: picks the decode split count
    query_len: int = 1  # new tokens per request when is_decode (1 + drafts on a uniform verify step)
    _tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def tiles(self, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([num_tiles] int32 request index, [num_tiles] int32 first query row) for tiles of `block_q`.

        Called by each layer's forward on non-uniform steps; computed once per tile height and step.
        """
        found = self._tiles.get(block_q)
        if found is None:
            found = query_tiles(self.common, np.arange(self.num_reqs), block_q)
            self._tiles[block_q] = found
        return found


class FlashMetadataBuilder:
    """Returned by `TritonFlashAttentionBackend.get_metadata_builder(device)`; one per KV cache group.

    `build` is called by the model runner once per step (and once per captured (batch size, query
    length) when the runner captures CUDA graphs). It never synchronizes with the device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def build(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        num_rows = int(common.query_start_loc_cpu[common.num_reqs]) if common.num_reqs else 0
        q = uniform_query_len(common, MAX_UNIFORM_QUERY_LEN)
        return FlashAttentionMetadata(
            common=common,
            is_decode=q > 0,
            num_reqs=common.num_reqs,
            num_actual_tokens=common.num_actual_tokens,
            num_query_rows=num_rows,
            max_seq_len=common.max_seq_len,
            query_len=max(q, 1),
        )
