"""InputBatch: the model runner's persistent, row-per-request host arrays (vLLM's InputBatch idea).

Each request the runner holds owns one row from the step it arrives (`add_request`) until the
scheduler tells the runner to forget it (`remove_request`); the row is then reused. Token ids, the
block table and the per-request sampling parameters live in preallocated numpy arrays, so a step's
flat inputs (token ids, positions, slot mapping, block table) and its sampling parameters are
gathered with a few vectorized indexing operations instead of one Python loop iteration (and one
small tensor) per request. Rows are not condensed: each step gathers the scheduled rows in the
scheduler's batch order, which costs the same as a copy of a condensed block.

Only the model runner calls this class, from its own thread; it never reads scheduler state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from keel.engine.sampling_params import SamplingParams

_U64 = (1 << 64) - 1


@dataclass
class StepInputs:
    """One step's flattened inputs on the host, in batch order (all numpy, ready for torch.from_numpy)."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    seq_lens: np.ndarray  # [num_reqs] int32
    block_table: np.ndarray  # [num_reqs, max_blocks] int32; unused entries 0 (the null block)
    slot_mapping: np.ndarray  # [num_tokens] int64
    num_sample_rows: np.ndarray  # [num_reqs] int64: rows whose next token is sampled (0 = none)
    max_query_len: int
    max_seq_len: int


TABLE_WIDTH_MULTIPLE = 16


def table_width(max_blocks: int) -> int:
    """Columns of a step's block table: the most blocks a request has, rounded up to a multiple of 16.
    Kernels get the row stride as an argument, and Triton compiles a separate variant for a stride that
    is 1, a multiple of 16, or neither -- a width that followed the batch would compile new variants of
    every attention kernel while serving. Padding columns hold 0 (the null block)."""
    return max(-(-max_blocks // TABLE_WIDTH_MULTIPLE), 1) * TABLE_WIDTH_MULTIPLE


def _grow(arr: np.ndarray, rows: int, cols: int | None = None) -> np.ndarray:
    shape = (rows,) if arr.ndim == 1 else (rows, cols if cols is not None else arr.shape[1])
    out = np.zeros(shape, dtype=arr.dtype)
    out[tuple(slice(0, n) for n in arr.shape)] = arr
    return out


class InputBatch:
    """Rows of request state, grown on demand (capacity doubles; no per-step allocation in steady state).

    `token_ids[row, :num_tokens[row]]` are the committed tokens (prompt + sampled outputs); positions
    past that may hold this step's draft tokens (tentative, overwritten by whatever is sampled next).
    `block_table[row, :num_blocks[row]]` is the request's block table; the rest of the row is 0.
    """

    _FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty")
    _INT_FIELDS = ("top_k", "seed", "min_tokens", "num_logprobs")

    def __init__(self, block_size: int, max_num_reqs: int = 64, max_model_len: int = 256) -> None:
        self.block_size = block_size
        cap, cols = max(max_num_reqs, 1), max(max_model_len, 1)
        self.token_ids = np.zeros((cap, cols), dtype=np.int64)
        self.num_tokens = np.zeros(cap, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(cap, dtype=np.int64)
        self.num_computed_tokens = np.zeros(cap, dtype=np.int64)
        # Speculative steps in flight: tokens the scheduler already counts (1 + drafts per step) that the
        # host has not received; they follow token_ids[row, :num_tokens] (see worker/spec_launch.py).
        self.num_in_flight = np.zeros(cap, dtype=np.int64)
        self.block_table = np.zeros((cap, -(-cols // block_size)), dtype=np.int32)
        self.num_blocks = np.zeros(cap, dtype=np.int64)
        # Sampling parameters per row, written once at add. Floats stay float64 here so the flags
        # (e.g. top_p >= 1) see the user's exact value; tensors get float32 as before.
        for name in self._FLOAT_FIELDS:
            setattr(self, name, np.zeros(cap, dtype=np.float64))
        for name in self._INT_FIELDS:
            setattr(self, name, np.zeros(cap, dtype=np.int64))
        self.uses_penalties = np.zeros(cap, dtype=bool)
        self.has_logit_bias = np.zeros(cap, dtype=bool)
        self.has_allowed_tokens = np.zeros(cap, dtype=bool)
        self.has_bad_words = np.zeros(cap, dtype=bool)
        self.wants_prompt_logprobs = np.zeros(cap, dtype=bool)
        self.params: list[SamplingParams | None] = [None] * cap
        self.stop_token_ids: list[frozenset[int]] = [frozenset()] * cap
        self._free_rows = list(range(cap - 1, -1, -1))
        # Bumped whenever a row is (re)assigned, so per-row caches elsewhere know the row changed.
        self.generation = np.zeros(cap, dtype=np.int64)

    @property
    def capacity(self) -> int:
        return self.num_tokens.shape[0]

    # ---------------------------------------------------------------- rows in and out

    def add_request(self, token_ids: list[int], num_prompt_tokens: int, num_computed_tokens: int,
                    block_ids: list[int], params: SamplingParams, seed: int,
                    stop_token_ids: frozenset[int]) -> int:
        """Called by the runner for each new (or resumed) request; returns its row."""
        if not self._free_rows:
            self._grow_rows(self.capacity * 2)
        row = self._free_rows.pop()
        n = len(token_ids)
        self.ensure_len(n)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_in_flight[row] = 0
        self.block_table[row] = 0
        self.num_blocks[row] = 0
        self.append_block_ids(row, block_ids)
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.top_k[row] = params.top_k
        # Any Python int seed maps to 64 bits, stored as the signed int64 with the same bits.
        self.seed[row] = ((seed & _U64) ^ (1 << 63)) - (1 << 63)
        self.min_tokens[row] = params.min_tokens
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.uses_penalties[row] = (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
                                    or params.repetition_penalty != 1.0)
        self.has_logit_bias[row] = bool(params.logit_bias)
        self.has_allowed_tokens[row] = bool(params.allowed_token_ids)
        self.has_bad_words[row] = bool(params.bad_words_token_ids)
        self.wants_prompt_logprobs[row] = params.prompt_logprobs is not None
        self.params[row] = params
        self.stop_token_ids[row] = stop_token_ids
        self.generation[row] += 1
        return row

    def remove_request(self, row: int) -> None:
        """Called by the runner when the scheduler says to forget the request; the row becomes free."""
        self.params[row] = None
        self._free_rows.append(row)

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            self.block_table = _grow(self.block_table, self.capacity, max(end, 2 * self.block_table.shape[1]))
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def ensure_len(self, num_tokens: int) -> None:
        """Make every row hold at least `num_tokens` token ids."""
        cols = self.token_ids.shape[1]
        if num_tokens > cols:
            self.token_ids = _grow(self.token_ids, self.capacity, max(num_tokens, 2 * cols))

    def _grow_rows(self, cap: int) -> None:
        old = self.capacity
        for name in ("token_ids", "num_tokens", "num_prompt_tokens", "num_computed_tokens", "num_in_flight",
                     "block_table",
                     "num_blocks", "uses_penalties", "has_logit_bias", "has_allowed_tokens", "has_bad_words",
                     "wants_prompt_logprobs", "generation",
                     *self._FLOAT_FIELDS, *self._INT_FIELDS):
            setattr(self, name, _grow(getattr(self, name), cap))
        self.params += [None] * (cap - old)
        self.stop_token_ids += [frozenset()] * (cap - old)
        self._free_rows = list(range(cap - 1, old - 1, -1)) + self._free_rows

    # ---------------------------------------------------------------- per step

    def write_drafts(self, row: int, drafts: list[int]) -> None:
        """Tentative draft tokens go right after the committed ones and those in flight (never counted in
        num_tokens)."""
        n = int(self.num_tokens[row] + self.num_in_flight[row])
        self.ensure_len(n + len(drafts))
        self.token_ids[row, n : n + len(drafts)] = drafts

    def prepare_inputs(self, rows: np.ndarray, num_scheduled: np.ndarray) -> StepInputs:
        """Flatten the scheduled tokens of `rows` (batch order) into one varlen batch, vectorized.

        rows: [num_reqs] int64; num_scheduled: [num_reqs] int64, each >= 1. Every request's tokens
        start at its row's `num_computed_tokens`.
        """
        num_reqs = rows.shape[0]
        cu = np.cumsum(num_scheduled)
        total = int(cu[-1])
        qsl = np.zeros(num_reqs + 1, dtype=np.int32)
        qsl[1:] = cu
        start = self.num_computed_tokens[rows]  # [num_reqs]
        if total == num_reqs:  # pure decode: one token per request, no repeat needed
            tok_rows, positions = rows, start.copy()
        else:
            req_index = np.repeat(np.arange(num_reqs), num_scheduled)
            tok_rows = rows[req_index]
            positions = start[req_index] + (np.arange(total) - (cu - num_scheduled)[req_index])
        seq_lens = start + num_scheduled
        max_blocks = table_width(int(self.num_blocks[rows].max()))
        if max_blocks > self.block_table.shape[1]:
            self.block_table = _grow(self.block_table, self.capacity, max_blocks)
        bs = self.block_size
        block_idx = positions // bs
        slot_mapping = self.block_table[tok_rows, block_idx].astype(np.int64) * bs + positions % bs
        # Rows from the last committed (or in-flight) token on predict unknown or draft tokens.
        num_sample_rows = np.maximum(seq_lens - (self.num_tokens[rows] + self.num_in_flight[rows] - 1), 0)
        return StepInputs(
            input_ids=self.token_ids[tok_rows, positions],
            positions=positions,
            query_start_loc=qsl,
            seq_lens=seq_lens.astype(np.int32),
            block_table=self.block_table[rows, :max_blocks],
            slot_mapping=slot_mapping,
            num_sample_rows=num_sample_rows,
            max_query_len=int(num_scheduled.max()),
            max_seq_len=int(seq_lens.max()),
        )

    def append_sampled(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """One committed token per row whose value is already known; rows are distinct."""
        self.fill_tokens(rows, self.advance(rows), tokens)

    def advance(self, rows: np.ndarray) -> np.ndarray:
        """Count one sampled token per row before its value is known; returns the positions it takes.

        The value stays -1 (an invalid id, so a missed fill fails loudly) until `fill_tokens`; the model
        runner feeds the token to the next step from the device meanwhile.
        """
        self.ensure_len(int(self.num_tokens[rows].max()) + 1)
        positions = self.num_tokens[rows].copy()
        self.token_ids[rows, positions] = -1
        self.num_tokens[rows] += 1
        return positions

    def fill_tokens(self, rows: np.ndarray, positions: np.ndarray, tokens: np.ndarray) -> None:
        """The values of tokens counted by `advance` (rows still held by the same requests)."""
        self.token_ids[rows, positions] = tokens

    def append_tokens(self, row: int, tokens: list[int]) -> None:
        """Several committed tokens of one row (accepted drafts plus one)."""
        n = int(self.num_tokens[row])
        self.ensure_len(n + len(tokens))
        self.token_ids[row, n : n + len(tokens)] = tokens
        self.num_tokens[row] = n + len(tokens)
