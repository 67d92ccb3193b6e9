"""Per-step attention inputs common to every backend, built by the model runner.

The runner flattens all scheduled tokens of a step into one sequence (varlen, unpadded). Request i
owns tokens `query_start_loc[i]:query_start_loc[i+1]`; its context after this step is `seq_lens[i]`
tokens, of which the last `query_len` are new (they may include tentative speculative tokens). A
backend's metadata builder turns this into whatever its kernels need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, device: context length including this step's tokens
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, device; unused entries = 0 (null)
    slot_mapping: torch.Tensor  # [num_tokens] int64, device: cache slot of each new token, -1 = skip
    num_reqs: int
    num_actual_tokens: int  # tokens of real requests; the flattened batch may be padded past this
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    @property
    def query_lens_cpu(self) -> torch.Tensor:  # [num_reqs] int32
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]
