"""Per-step metadata of triton_flash, built once per step and shared by every layer.

A pure-decode step (every request has one new token) needs nothing beyond the common metadata's
device tensors, so its metadata stays valid when the runner refills those tensors in place: that is
what lets the model runner capture decode steps as CUDA graphs. Other steps get a query-tile table
(which request, which first query row) built on the CPU from `query_start_loc_cpu`, per tile height.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from keel.attention.metadata import CommonAttentionMetadata


@dataclass
class FlashAttentionMetadata:
    """What `TritonFlashAttentionImpl.forward` reads; one object per step."""

    common: CommonAttentionMetadata
    is_decode: bool  # every request has exactly one new token: the split-K decode kernels run
    num_reqs: int
    num_actual_tokens: int  # tokens whose K/V are written (padding rows carry slot -1)
    num_query_rows: int  # rows with an output of a real request (query_start_loc[-1])
    max_seq_len: int  # an upper bound of seq_lens: picks the decode split count
    _tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def tiles(self, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([num_tiles] int32 request index, [num_tiles] int32 first query row) for tiles of `block_q`.

        Called by each layer's forward on non-decode steps; computed once per tile height and step.
        """
        found = self._tiles.get(block_q)
        if found is None:
            qsl = self.common.query_start_loc_cpu[: self.num_reqs + 1].to(torch.int64)
            query_lens = qsl[1:] - qsl[:-1]
            per_req = (query_lens + block_q - 1) // block_q
            tile_req = torch.repeat_interleave(torch.arange(self.num_reqs), per_req)
            first_tile = torch.cumsum(per_req, 0) - per_req
            tile_q0 = (torch.arange(int(per_req.sum())) - first_tile[tile_req]) * block_q
            device = self.common.query_start_loc.device
            found = (tile_req.to(torch.int32).to(device, non_blocking=True),
                     tile_q0.to(torch.int32).to(device, non_blocking=True))
            self._tiles[block_q] = found
        return found


class FlashMetadataBuilder:
    """Returned by `TritonFlashAttentionBackend.get_metadata_builder(device)`; one per KV cache group.

    `build` is called by the model runner once per step (and once per captured batch size when the
    runner captures CUDA graphs). It never synchronizes with the device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def build(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        num_rows = int(common.query_start_loc_cpu[common.num_reqs]) if common.num_reqs else 0
        return FlashAttentionMetadata(
            common=common,
            is_decode=common.max_query_len == 1,
            num_reqs=common.num_reqs,
            num_actual_tokens=common.num_actual_tokens,
            num_query_rows=num_rows,
            max_seq_len=common.max_seq_len,
        )
