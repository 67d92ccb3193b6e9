"""Per-step metadata of triton_mla, built once per step and shared by every MLA layer.

A uniform step -- every request has the same number q <= MAX_UNIFORM_QUERY_LEN of new tokens: pure
decode (q = 1) or speculative verification with equal drafts (q = 1 + drafts) -- runs the split-K
latent kernel with q query rows per request. It needs nothing beyond the common metadata's device
tensors (request i is tile i) and its launch grids depend only on (num_reqs, q, max_seq_len), so the
model runner may capture it as a CUDA graph. Other steps split their requests in two by their number
of new tokens: decode requests (exactly one) run the split-K kernel through a request table; the others
(prefill, chunked prefill, uneven verification) run query tiles of the same latent kernel without
splits, from request/tile tables built on the CPU from `query_start_loc_cpu`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from keel.attention.metadata import CommonAttentionMetadata
from keel.worker.staging import host_to_device
from keel_attention_flash.metadata import MAX_UNIFORM_QUERY_LEN, query_tiles, uniform_query_len


@dataclass
class TritonMLAMetadata:
    """What `TritonMLAImpl.forward` reads; one object per step."""

    common: CommonAttentionMetadata
    num_reqs: int
    num_actual_tokens: int  # tokens whose latents are written (padding rows carry slot -1)
    num_query_rows: int  # rows with an output of a real request (query_start_loc[num_reqs])
    max_seq_len: int  # an upper bound of seq_lens: picks the decode split count
    num_decodes: int  # requests on the split-K path: one new token each, or all of a uniform step
    decode_reqs: torch.Tensor | None  # [num_decodes] int32 device; None: request i is decode i (pure decode)
    prefill_reqs: list[int]  # requests with more than one new token (CPU indices)
    query_len: int = 1  # new tokens per split-K request (> 1 only on a uniform verify step)
    _tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def is_decode(self) -> bool:
        return self.decode_reqs is None

    def prefill_tiles(self, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([num_tiles] int32 request, [num_tiles] int32 first query row) over the prefill requests.

        Called by each layer's forward on steps with prefill rows; computed once per tile height.
        """
        found = self._tiles.get(block_q)
        if found is None:
            found = query_tiles(self.common, np.asarray(self.prefill_reqs, dtype=np.int64), block_q)
            self._tiles[block_q] = found
        return found


class TritonMLAMetadataBuilder:
    """Returned by `TritonMLABackend.get_metadata_builder(device)`; one per KV cache group.

    `build` is called by the model runner once per step (and once per captured batch size when the
    runner captures CUDA graphs). It never synchronizes with the device: on mixed steps it reads only
    the CPU copy of `query_start_loc`, and its request / tile tables go up from pinned memory.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def build(self, common: CommonAttentionMetadata) -> TritonMLAMetadata:
        n = common.num_reqs
        num_rows = int(common.query_start_loc_cpu[n]) if n else 0
        q = uniform_query_len(common, MAX_UNIFORM_QUERY_LEN)
        if common.max_query_len <= 1 or q > 1:
            decode_reqs, prefill_reqs, num_decodes = None, [], n
        else:
            qsl = common.query_start_loc_cpu.numpy()
            query_lens = qsl[1 : n + 1] - qsl[:n]
            decode_idx = np.flatnonzero(query_lens == 1).astype(np.int32)
            prefill_reqs = np.flatnonzero(query_lens > 1).tolist()
            num_decodes = int(decode_idx.size)
            decode_reqs = host_to_device(torch.from_numpy(decode_idx), common.query_start_loc.device)
        return TritonMLAMetadata(
            common=common,
            num_reqs=n,
            num_actual_tokens=common.num_actual_tokens,
            num_query_rows=num_rows,
            max_seq_len=common.max_seq_len,
            num_decodes=num_decodes,
            decode_reqs=decode_reqs,
            prefill_reqs=prefill_reqs,
            query_len=max(q, 1),
        )
