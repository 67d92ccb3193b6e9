"""Per-step metadata of the torch_paged backend: everything index-shaped, computed once per step.

The model runner calls `TorchPagedMetadataBuilder.build(common)` once per step; the result is handed
to every attention layer's `forward`. Layers then only gather, attend and scatter.

The builder is shared by all layers of a KV cache group but is not told their sliding window, so the
window-dependent part (`AttentionPlan`: gather indices and masks) is built on first use per distinct
window and memoized on the step's metadata: layer 0 pays for it, every later layer reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from keel.attention.metadata import CommonAttentionMetadata


@dataclass
class DecodePlan:
    """Requests with exactly one new token, attended as one padded batch [B, key_len].

    Keys are right-aligned: column j of request b is position `seq_len_b - key_len + j`. Columns that
    fall before position 0 or outside the window point at the request's newest token (just written
    this step, hence finite even in a never-initialized cache) and are masked out.
    """

    rows: slice | torch.Tensor  # token rows of q/out: a slice when contiguous, else [B] int64
    num_reqs: int
    key_len: int
    slots: torch.Tensor  # [B * key_len] int64 cache slots to gather
    mask: torch.Tensor | None  # [B, 1, 1, key_len] bool, True = attend; None = attend to all


@dataclass
class PrefillSeq:
    """One request with more than one new token; its keys are `slots[key_start:key_end]` of the plan."""

    token_start: int
    token_end: int
    key_start: int
    key_end: int
    mask: torch.Tensor | None  # [query_len, key_len] bool, True = attend; None = square causal


@dataclass
class AttentionPlan:
    decode: DecodePlan | None
    prefill: list[PrefillSeq]
    prefill_slots: torch.Tensor | None  # [sum of key_len over prefill requests] int64


@dataclass
class TorchPagedAttentionMetadata:
    """What `TorchPagedAttentionImpl.forward` reads. Built by the builder; one object per step."""

    common: CommonAttentionMetadata
    num_tokens: int  # tokens with an output row of real requests (query_start_loc[-1])
    write_rows: torch.Tensor | None  # [n] int64 token rows to write; None = rows 0..len(write_slots)-1
    write_slots: torch.Tensor  # [n] int64 cache slots, all >= 0
    decode_reqs: list[int]
    prefill_reqs: list[int]
    _plans: dict[int | None, AttentionPlan] = field(default_factory=dict)

    def plan(self, sliding_window: int | None) -> AttentionPlan:
        """Called by each layer's forward; computes the plan for this window once per step."""
        found = self._plans.get(sliding_window)
        if found is None:
            found = _build_plan(self, sliding_window)
            self._plans[sliding_window] = found
        return found


class TorchPagedMetadataBuilder:
    """Returned by `TorchPagedAttentionBackend.get_metadata_builder(device)`; one per KV cache group.

    `build` is called by the model runner once per step. It synchronizes with the device at most once
    (to drop slots marked -1 among the real tokens), which is free on the CPU.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def build(self, common: CommonAttentionMetadata) -> TorchPagedAttentionMetadata:
        qsl = common.query_start_loc_cpu.tolist()
        query_lens = [qsl[i + 1] - qsl[i] for i in range(common.num_reqs)]
        num_tokens = qsl[common.num_reqs] if common.num_reqs else 0
        slots = common.slot_mapping[: common.num_actual_tokens]
        valid = slots >= 0
        if bool(valid.all()):
            write_rows, write_slots = None, slots
        else:
            write_rows = valid.nonzero().squeeze(1)
            write_slots = slots[write_rows]
        return TorchPagedAttentionMetadata(
            common=common,
            num_tokens=num_tokens,
            write_rows=write_rows,
            write_slots=write_slots,
            decode_reqs=[i for i, n in enumerate(query_lens) if n == 1],
            prefill_reqs=[i for i, n in enumerate(query_lens) if n > 1],
        )


def _slots_of(block_table_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    # block_table_row: [..., max_blocks] int64, positions: [..., n] int64 -> [..., n] int64 slots
    return block_table_row.gather(-1, positions // block_size) * block_size + positions % block_size


def _build_plan(md: TorchPagedAttentionMetadata, window: int | None) -> AttentionPlan:
    return AttentionPlan(decode=_decode_plan(md, window), **_prefill_plan(md, window))


def _decode_plan(md: TorchPagedAttentionMetadata, window: int | None) -> DecodePlan | None:
    reqs = md.decode_reqs
    if not reqs:
        return None
    common = md.common
    device = common.block_table.device
    all_seq_lens = common.seq_lens_cpu.tolist()
    seq_lens_cpu = [all_seq_lens[i] for i in reqs]
    key_len = max(seq_lens_cpu) if window is None else min(max(seq_lens_cpu), window)
    qsl = common.query_start_loc_cpu
    first_row = int(qsl[reqs[0]])
    if reqs == list(range(reqs[0], reqs[-1] + 1)):
        rows: slice | torch.Tensor = slice(first_row, first_row + len(reqs))
        seq_lens = common.seq_lens[reqs[0] : reqs[-1] + 1].long()
        table = common.block_table[reqs[0] : reqs[-1] + 1].long()
    else:
        rows = qsl[reqs].long().to(device)
        idx = torch.tensor(reqs, dtype=torch.long, device=device)
        seq_lens = common.seq_lens.index_select(0, idx).long()
        table = common.block_table.index_select(0, idx).long()
    positions = seq_lens[:, None] - key_len + torch.arange(key_len, device=device)  # [B, key_len]
    masked = positions < 0
    positions = torch.where(masked, seq_lens[:, None] - 1, positions)
    slots = _slots_of(table, positions, common.block_size)
    # Whether any column is masked is known on the CPU: only requests shorter than key_len have one.
    mask = ~masked[:, None, None, :] if min(seq_lens_cpu) < key_len else None
    return DecodePlan(rows=rows, num_reqs=len(reqs), key_len=key_len, slots=slots.reshape(-1), mask=mask)


def _prefill_plan(md: TorchPagedAttentionMetadata, window: int | None) -> dict:
    common = md.common
    if not md.prefill_reqs:
        return {"prefill": [], "prefill_slots": None}
    device = common.block_table.device
    qsl = common.query_start_loc_cpu.tolist()
    seq_lens = common.seq_lens_cpu.tolist()
    seqs: list[PrefillSeq] = []
    slot_parts: list[torch.Tensor] = []
    offset = 0
    for i in md.prefill_reqs:
        seq_len = seq_lens[i]
        query_len = qsl[i + 1] - qsl[i]
        first_pos = seq_len - query_len
        # Keys older than the window of the first new token are never read (their blocks may be freed).
        key_start = 0 if window is None else max(0, first_pos - window + 1)
        key_pos = torch.arange(key_start, seq_len, device=device)
        slot_parts.append(_slots_of(common.block_table[i].long(), key_pos, common.block_size))
        mask = None
        if key_start != 0 or first_pos != 0 or (window is not None and window < query_len):
            q_pos = torch.arange(first_pos, seq_len, device=device)[:, None]
            mask = key_pos[None, :] <= q_pos
            if window is not None:
                mask &= key_pos[None, :] > q_pos - window
        key_len = seq_len - key_start
        seqs.append(PrefillSeq(qsl[i], qsl[i + 1], offset, offset + key_len, mask))
        offset += key_len
    return {"prefill": seqs, "prefill_slots": torch.cat(slot_parts)}
