"""SamplingMetadata from the persistent input batch: per-row parameters gathered, not rebuilt.

`SamplingMetadata.build` turns Python lists into about ten small tensors and, when any row uses a
penalty, counts every request's prompt and outputs again, every step. Here the parameters were
written once per row at add (`InputBatch.add_request`); a step gathers the sampling rows with numpy
fancy indexing and derives the flags from those arrays. Penalty state (output token counts, prompt
masks) lives in per-row device tensors, built once when a penalized row first samples and then
advanced by one scatter per step.

The result equals `SamplingMetadata.build` for one sampling row per request (steps without draft
tokens), except that the count/mask rows of requests without any penalty are zero: those rows are
multiplied by zero penalties (or divided by 1.0), so the sampled tokens are the same.
"""

from __future__ import annotations

import numpy as np
import torch

from keel.engine.sampling_params import _SAMPLING_EPS
from keel.layers.bad_words import banned_by_bad_words
from keel.layers.sampling_metadata import SamplingMetadata, _logit_bias_tensor, allowed_token_mask, token_counts
from keel.worker.input_batch import InputBatch
from keel.worker.staging import host_to_device


class BatchSamplingState:
    """Owned by the model runner; `build` once per step without drafts, then `record_sampled`."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.output_counts: torch.Tensor | None = None  # [capacity, vocab] int32, penalized rows only
        self.prompt_mask: torch.Tensor | None = None  # [capacity, vocab] bool
        self._ready_gen = np.zeros(0, dtype=np.int64)  # row generation the penalty state was built for

    def invalidate(self, rows: np.ndarray) -> None:
        """Penalty state of these rows is stale (a step with drafts appended several tokens)."""
        if self._ready_gen.shape[0]:
            self._ready_gen[rows[rows < self._ready_gen.shape[0]]] = -1

    def _ensure(self, capacity: int, vocab: int) -> None:
        if self.output_counts is not None and self.output_counts.shape == (capacity, vocab):
            return
        counts = torch.zeros((capacity, vocab), dtype=torch.int32, device=self.device)
        mask = torch.zeros((capacity, vocab), dtype=torch.bool, device=self.device)
        ready = np.full(capacity, -1, dtype=np.int64)
        if self.output_counts is not None and self.output_counts.shape[1] == vocab:
            old = self.output_counts.shape[0]
            counts[:old] = self.output_counts
            mask[:old] = self.prompt_mask
            ready[:old] = self._ready_gen
        self.output_counts, self.prompt_mask, self._ready_gen = counts, mask, ready

    def _prepare_penalty_rows(self, batch: InputBatch, rows: np.ndarray, vocab: int) -> None:
        """Build counts/masks of penalized rows seen for the first time (or since invalidated)."""
        self._ensure(batch.capacity, vocab)
        stale = rows[self._ready_gen[rows] != batch.generation[rows]]
        if stale.shape[0] == 0:
            return
        outputs, prompts = [], []
        for row in stale.tolist():
            num_prompt, num = int(batch.num_prompt_tokens[row]), int(batch.num_tokens[row])
            prompts.append(batch.token_ids[row, :num_prompt].tolist())
            outputs.append(batch.token_ids[row, num_prompt:num].tolist())
        idx = torch.from_numpy(stale).to(self.device)
        self.output_counts[idx] = token_counts(outputs, vocab, self.device)
        self.prompt_mask[idx] = token_counts(prompts, vocab, self.device) > 0
        self._ready_gen[stale] = batch.generation[stale]

    @staticmethod
    def host_arrays(batch: InputBatch, rows: np.ndarray, vocab_size: int) -> dict[str, np.ndarray]:
        """The per-row tensors of the metadata as host arrays in their final dtypes (the runner stages
        them with the step's other inputs, one copy)."""
        raw_k = batch.top_k[rows]
        return {
            "temperature": batch.temperature[rows].astype(np.float32),
            "top_p": batch.top_p[rows].astype(np.float32),
            "top_k": np.where(raw_k == 0, vocab_size, np.minimum(raw_k, vocab_size)),
            "min_p": batch.min_p[rows].astype(np.float32),
            "presence_penalties": batch.presence_penalty[rows].astype(np.float32),
            "frequency_penalties": batch.frequency_penalty[rows].astype(np.float32),
            "repetition_penalties": batch.repetition_penalty[rows].astype(np.float32),
            "seeds": batch.seed[rows],
            "step": batch.num_tokens[rows] - batch.num_prompt_tokens[rows],
            "rows": rows.astype(np.int64, copy=False),  # the penalty state's rows, gathered on the device
        }

    def build(self, batch: InputBatch, rows: np.ndarray, vocab_size: int,
              staged: dict[str, torch.Tensor] | None = None) -> SamplingMetadata:
        """Metadata for `rows` (one logits row each, in this order). `staged`: the device tensors of
        `host_arrays(batch, rows, vocab_size)` when the caller already moved them. Raises ValueError
        for a logit_bias token outside the vocabulary, as `SamplingMetadata.build`."""
        dev = self.device
        # Flags read the user's exact (float64) values, as SamplingMetadata.build does.
        temperature = batch.temperature[rows]
        top_p = batch.top_p[rows]
        min_p = batch.min_p[rows]
        raw_k = batch.top_k[rows]
        if staged is None:
            staged = {k: torch.from_numpy(v).to(dev) for k, v in self.host_arrays(batch, rows, vocab_size).items()}
        greedy = temperature < _SAMPLING_EPS
        num_outputs = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
        penalized = batch.uses_penalties[rows]
        num_logprobs = batch.num_logprobs[rows]
        max_lp = int(num_logprobs.max()) if rows.shape[0] else -1
        meta = SamplingMetadata(
            temperature=staged["temperature"],
            top_p=staged["top_p"],
            top_k=staged["top_k"],
            min_p=staged["min_p"],
            presence_penalties=staged["presence_penalties"],
            frequency_penalties=staged["frequency_penalties"],
            repetition_penalties=staged["repetition_penalties"],
            seeds=staged["seeds"],
            step=staged["step"],
            all_greedy=bool(greedy.all()),
            all_random=not bool(greedy.any()),
            no_penalties=not bool(penalized.any()),
            no_top_k=bool(((raw_k == 0) | (raw_k >= vocab_size)).all()),
            no_top_p=bool((top_p >= 1.0).all()),
            no_min_p=bool((min_p <= 0.0).all()),
            max_num_logprobs=max_lp if max_lp >= 0 else None,
            vocab_size=vocab_size,
        )
        if not meta.no_penalties:
            self._prepare_penalty_rows(batch, rows[penalized], vocab_size)
            idx = staged["rows"]
            meta.output_token_counts = self.output_counts[idx]
            meta.prompt_token_mask = self.prompt_mask[idx]
            if not penalized.all():
                # Rows without penalties read zeros here (never written): harmless, their penalties are 0/1.
                unpenalized = host_to_device(torch.from_numpy(~penalized), dev)
                meta.output_token_counts.masked_fill_(unpenalized[:, None], 0)
                meta.prompt_token_mask.masked_fill_(unpenalized[:, None], False)
        banned_rows = num_outputs < batch.min_tokens[rows]
        bad_rows = batch.has_bad_words[rows]
        if banned_rows.any() or bad_rows.any():
            banned = [self._banned(batch, r, b, w, vocab_size)
                      for r, b, w in zip(rows.tolist(), banned_rows.tolist(), bad_rows.tolist())]
            if any(banned):
                meta.min_tokens_mask = token_counts(banned, vocab_size, dev) > 0
        if batch.has_logit_bias[rows].any():
            meta.logit_bias = _logit_bias_tensor([batch.params[r] for r in rows.tolist()], vocab_size, dev)
        if batch.has_allowed_tokens[rows].any():
            meta.allowed_token_mask = allowed_token_mask([batch.params[r] for r in rows.tolist()], vocab_size, dev)
        return meta

    @staticmethod
    def _banned(batch: InputBatch, row: int, min_tokens: bool, bad_words: bool, vocab_size: int) -> list[int]:
        """A row's banned tokens this step: stop tokens before min_tokens, bad words' last tokens (from its
        committed output on the host: the runner waits for tokens in flight when a row has bad words)."""
        out = [t for t in batch.stop_token_ids[row] if t < vocab_size] if min_tokens else []
        if bad_words:
            words = batch.params[row].bad_words_token_ids
            longest = max(len(w) for w in words)
            num_prompt, num = int(batch.num_prompt_tokens[row]), int(batch.num_tokens[row])
            tail = batch.token_ids[row, max(num_prompt, num - longest + 1):num].tolist()
            out += banned_by_bad_words(words, tail)
        return out

    def record_sampled(self, batch: InputBatch, rows: np.ndarray, tokens: torch.Tensor,
                       rows_on_device: torch.Tensor | None = None) -> None:
        """After a step without drafts: count each penalized row's new token (rows: [B], tokens: [B];
        `rows_on_device`: the same rows already on the device, as `build` staged them, if so)."""
        if self.output_counts is None:
            return
        mask = batch.uses_penalties[rows]
        if not mask.any():
            return
        sel = rows[mask]
        ready = self._ready_gen[sel] == batch.generation[sel]
        if not ready.all():  # never built: it will be, from the token ids, when it next samples
            mask[np.flatnonzero(mask)[~ready]] = False
            sel = sel[ready]
        if sel.shape[0] == 0:
            return
        tokens = tokens.to(self.device)
        if rows_on_device is not None and sel.shape[0] == rows.shape[0]:  # every row: no selection to copy
            idx, picked = rows_on_device, tokens
        else:
            idx = host_to_device(torch.from_numpy(sel), self.device)
            picked = tokens[host_to_device(torch.from_numpy(np.flatnonzero(mask)), self.device)]
        self.output_counts.index_put_((idx, picked), torch.ones_like(picked, dtype=torch.int32),
                                      accumulate=True)

