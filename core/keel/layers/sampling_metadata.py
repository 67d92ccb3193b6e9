"""`SamplingMetadata`: one step's sampling parameters of a batch, as device tensors for the `Sampler`.

The model runner builds it once per step (`SamplingMetadata.build`) for the requests that sample this
step, in the row order of the logits it hands to the sampler. Flags let the sampler skip work no
request in the batch asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from keel.engine.sampling_params import _SAMPLING_EPS, SamplingParams
from keel.layers.bad_words import banned_by_bad_words
from keel.logits_processor import LogitsProcessors

_U64 = (1 << 64) - 1


@dataclass
class SamplingMetadata:
    """Per-row (one row per request sampling this step) tensors on the sampling device.

    Greedy rows keep their temperature (< 1e-5); the sampler takes their argmax and never divides by it.
    Tensors that only penalties, min_tokens or logit_bias need are None when no row uses them.
    """

    temperature: torch.Tensor  # [B] float32
    top_p: torch.Tensor  # [B] float32; 1.0 when disabled
    top_k: torch.Tensor  # [B] int64; vocab_size when disabled
    min_p: torch.Tensor  # [B] float32; 0.0 when disabled
    presence_penalties: torch.Tensor  # [B] float32
    frequency_penalties: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64: the effective per-request seed the engine chose
    step: torch.Tensor  # [B] int64: output tokens generated so far (the noise counter)

    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    max_num_logprobs: int | None  # the most `logprobs` any row asked for; None when none did

    vocab_size: int
    output_token_counts: torch.Tensor | None = None  # [B, vocab] int32, None when no_penalties
    prompt_token_mask: torch.Tensor | None = None  # [B, vocab] bool, None when no_penalties
    # [B, vocab] bool: tokens banned this step (stop tokens before min_tokens, bad words), or None
    min_tokens_mask: torch.Tensor | None = None
    allowed_token_mask: torch.Tensor | None = None  # [B, vocab] bool: True = may be sampled, or None
    logit_bias: torch.Tensor | None = None  # [B, vocab] float32, or None
    logitsprocs: LogitsProcessors | None = None  # plugin logits processors, set by the model runner

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        seeds: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
        stop_token_ids_for_min_tokens: Sequence[set[int]],
    ) -> SamplingMetadata:
        """Called by the model runner each step; all sequences are indexed by logits row.

        `seeds[i]` is the request's effective seed, always used: the engine derives it from
        `params.seed` (distinct per child when n > 1) or draws it once per unseeded request and keeps
        it, so every request's stream is a function of its own state only.
        `stop_token_ids_for_min_tokens[i]` (usually `params.all_stop_token_ids`) is banned while the
        request has fewer than `min_tokens` output tokens. Raises ValueError for a token id outside
        the vocabulary in `logit_bias`.
        """
        b = len(params)
        stop_sets = stop_token_ids_for_min_tokens
        if {len(output_token_ids), len(prompt_token_ids), len(seeds), len(stop_sets)} != {b}:
            raise ValueError(
                "SamplingMetadata.build needs one entry per request in every argument; got "
                f"{b} params, {len(output_token_ids)} output_token_ids, {len(prompt_token_ids)} "
                f"prompt_token_ids, {len(seeds)} seeds, {len(stop_sets)} stop sets."
            )
        device = torch.device(device)

        def _f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def _i64(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        greedy = [p.temperature < _SAMPLING_EPS for p in params]
        top_k = [vocab_size if p.top_k == 0 else min(p.top_k, vocab_size) for p in params]
        # Any Python int seed maps to 64 bits, stored as the signed int64 with the same bits.
        signed = [((s & _U64) ^ (1 << 63)) - (1 << 63) for s in seeds]
        no_penalties = all(
            p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
            for p in params
        )
        num_logprobs = [p.logprobs for p in params if p.logprobs is not None]

        meta = cls(
            temperature=_f32([p.temperature for p in params]),
            top_p=_f32([p.top_p for p in params]),
            top_k=_i64(top_k),
            min_p=_f32([p.min_p for p in params]),
            presence_penalties=_f32([p.presence_penalty for p in params]),
            frequency_penalties=_f32([p.frequency_penalty for p in params]),
            repetition_penalties=_f32([p.repetition_penalty for p in params]),
            seeds=_i64(signed),
            step=_i64([len(o) for o in output_token_ids]),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_penalties=no_penalties,
            no_top_k=all(k == vocab_size for k in top_k),
            no_top_p=all(p.top_p >= 1.0 for p in params),
            no_min_p=all(p.min_p <= 0.0 for p in params),
            max_num_logprobs=max(num_logprobs) if num_logprobs else None,
            vocab_size=vocab_size,
        )
        if not no_penalties:
            meta.output_token_counts = token_counts(output_token_ids, vocab_size, device)
            meta.prompt_token_mask = token_counts(prompt_token_ids, vocab_size, device) > 0
        banned = [
            ([t for t in stops if t < vocab_size] if len(out) < p.min_tokens else [])
            + (banned_by_bad_words(p.bad_words_token_ids, out) if p.bad_words_token_ids else [])
            for p, out, stops in zip(params, output_token_ids, stop_sets, strict=True)
        ]
        if any(banned):
            meta.min_tokens_mask = token_counts(banned, vocab_size, device) > 0
        if any(p.logit_bias for p in params):
            meta.logit_bias = _logit_bias_tensor(params, vocab_size, device)
        if any(p.allowed_token_ids for p in params):
            meta.allowed_token_mask = allowed_token_mask(params, vocab_size, device)
        return meta


def allowed_token_mask(params: Sequence[SamplingParams], vocab_size: int,
                       device: torch.device) -> torch.Tensor:  # [B, vocab] bool
    """True where a row may sample; rows without `allowed_token_ids` allow everything."""
    mask = token_counts([p.allowed_token_ids or () for p in params], vocab_size, device) > 0
    free = torch.tensor([not p.allowed_token_ids for p in params], device=device)
    return mask | free[:, None]


def token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:  # [B, vocab] int32
    """Per-row occurrence counts, counted on the device from one flat transfer of all ids."""
    b = len(token_ids)
    flat = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64)
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
    flat, lengths = flat.to(device, non_blocking=True), lengths.to(device, non_blocking=True)
    rows = torch.repeat_interleave(torch.arange(b, device=device), lengths)
    counts = torch.zeros((b, vocab_size), dtype=torch.int32, device=device)
    counts.index_put_((rows, flat), torch.ones_like(flat, dtype=torch.int32), accumulate=True)
    return counts


def _logit_bias_tensor(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device
) -> torch.Tensor:  # [B, vocab] float32
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, p in enumerate(params):
        for tok, bias in (p.logit_bias or {}).items():
            if tok >= vocab_size:
                raise ValueError(
                    f"logit_bias token id {tok} is out of range for a vocabulary of size {vocab_size}."
                )
            rows.append(i)
            cols.append(tok)
            vals.append(bias)
    bias_t = torch.zeros((len(params), vocab_size), dtype=torch.float32)
    bias_t[rows, cols] = torch.tensor(vals, dtype=torch.float32)
    return bias_t.to(device, non_blocking=True)
