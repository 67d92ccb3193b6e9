"""The batched sampler: logits of one step -> one token per request, plus logprobs.

Every row is processed by the same tensor ops, whatever mix of greedy, random and seeded requests the
batch holds: no per-request Python in the hot path. Randomness is a counter-based hash of
(seed, step, token id), so a request's tokens depend only on its own seed and its own progress, never
on what else is in the batch or on a shared generator's position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from keel.engine.sampling_params import _SAMPLING_EPS
from keel.layers.sampling_metadata import SamplingMetadata

_M32 = 0xFFFFFFFF


@dataclass
class SamplerOutput:
    """What the sampler returns to the model runner for one step.

    Logprob columns: 0 is the sampled token (its raw logprob and rank), 1..max_num_logprobs are the
    top raw logprobs in descending order (ranks 1..k). A request that asked for fewer logprobs than
    `max_num_logprobs` uses the first `1 + its logprobs` columns.
    """

    sampled_token_ids: torch.Tensor  # [B] int64
    logprob_token_ids: torch.Tensor | None = None  # [B, max_num_logprobs + 1] int64
    logprobs: torch.Tensor | None = None  # [B, max_num_logprobs + 1] float32
    ranks: torch.Tensor | None = None  # [B, max_num_logprobs + 1] int64


def compute_logprobs(
    logits: torch.Tensor,  # [N, vocab]
    token_ids: torch.Tensor,  # [N] int64
    num_logprobs: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # 3 x [N, num_logprobs + 1]
    """Raw logprobs of `token_ids` and the top `num_logprobs` tokens, with ranks.

    Used by the sampler for sampled tokens and by the model runner for prompt logprobs (logits at
    prompt positions, `token_ids` the next prompt tokens). Column layout as in `SamplerOutput`.
    """
    return gather_logprobs(logits.to(torch.float32).log_softmax(dim=-1), token_ids, num_logprobs)


def gather_logprobs(
    logprobs: torch.Tensor,  # [N, vocab] float32, already normalized
    token_ids: torch.Tensor,  # [N] int64
    num_logprobs: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # 3 x [N, num_logprobs + 1]
    """`compute_logprobs` for logprobs already computed; rank = 1 + count of strictly larger ones."""
    n, vocab = logprobs.shape
    if not 0 <= num_logprobs <= vocab:
        raise ValueError(f"num_logprobs must be in [0, {vocab}] (the vocabulary size), got {num_logprobs}.")
    token_ids = token_ids.to(torch.int64).view(n, 1)
    token_lp = logprobs.gather(1, token_ids)  # [N, 1]
    token_rank = (logprobs > token_lp).sum(dim=-1, keepdim=True) + 1  # [N, 1]
    top_lp, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [N, k]
    top_ranks = torch.arange(1, num_logprobs + 1, device=logprobs.device).expand(n, num_logprobs)
    return (
        torch.cat([token_ids, top_ids], dim=1),
        torch.cat([token_lp, top_lp], dim=1),
        torch.cat([token_rank, top_ranks], dim=1),
    )


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x in [0, 2**32) without int64 overflow (whose wrapping torch leaves undefined)."""
    if c < (1 << 31):
        return (x * c) & _M32
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash with full avalanche (Wellons' lowbias32), on int64 holding 32 bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def random_uniform(
    seeds: torch.Tensor,  # [B] int64
    step: torch.Tensor,  # [B] int64
    vocab_size: int,
) -> torch.Tensor:  # [B, vocab] float32 in (0, 1)
    """Uniforms that are a pure function of (seed, step, token id): the sampler's only randomness.

    Two rows with the same (seed, step) get identical values wherever they sit in whatever batch.
    """
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32
    st = step & _M32
    k1 = _hash32(_hash32(_hash32(lo ^ 0x243F6A88) ^ hi) ^ st)[:, None]  # [B, 1]
    k2 = _hash32(k1 ^ _hash32(st ^ 0x85A308D3)[:, None])  # [B, 1]
    tok = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)[None, :]  # [1, vocab]
    h = _hash32(_hash32(tok ^ k1) ^ k2)  # [B, vocab], distinct per token within a row
    # Full 32 bits keep resolution near 0, where the exponential race decides rare tokens. `| 1`
    # keeps u > 0 and a power-of-two scale is exact, so a fused kernel rounds exactly like eager;
    # the clamp keeps values that round up to 2**32 strictly below 1.
    u = (h | 1).to(torch.float32) * (2.0**-32)
    return u.clamp(max=1.0 - 2.0**-24)


def log_exponential_noise(
    seeds: torch.Tensor,  # [B] int64
    step: torch.Tensor,  # [B] int64
    vocab_size: int,
) -> torch.Tensor:  # [B, vocab] float32
    """log(E) with E ~ Exp(1) from `random_uniform`; -log1p(-u) keeps small E precise."""
    return torch.log(-torch.log1p(-random_uniform(seeds, step, vocab_size)))


_compiled_noise: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None


def _noise_for(device: torch.device) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    """Eager ~40 elementwise int64 passes over [B, vocab] cost milliseconds on a GPU; compiled they
    fuse into one kernel that only writes its output. Integer ops make the result identical."""
    global _compiled_noise
    if device.type != "cuda":
        return log_exponential_noise
    if _compiled_noise is None:
        _compiled_noise = torch.compile(log_exponential_noise, dynamic=True, fullgraph=True)
    return _compiled_noise


def apply_penalties(
    logits: torch.Tensor,  # [B, vocab] float32
    meta: SamplingMetadata,
) -> torch.Tensor:  # [B, vocab]
    """vLLM's penalties: repetition on prompt+output tokens, frequency and presence on output tokens."""
    if meta.output_token_counts is None or meta.prompt_token_mask is None:
        raise ValueError("apply_penalties needs SamplingMetadata built with penalties (no_penalties=False).")
    counts = meta.output_token_counts.to(logits.dtype)  # [B, vocab]
    in_output = meta.output_token_counts > 0
    seen = in_output | meta.prompt_token_mask
    rep = torch.where(seen, meta.repetition_penalties[:, None], 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - meta.frequency_penalties[:, None] * counts
    return logits - meta.presence_penalties[:, None] * in_output.to(logits.dtype)


def apply_top_k_top_p(
    logits: torch.Tensor,  # [B, vocab] float32, temperature applied
    top_k: torch.Tensor | None,  # [B] int64 (vocab_size = off), or None for no row
    top_p: torch.Tensor | None,  # [B] float32 (1.0 = off), or None for no row
) -> torch.Tensor:  # [B, vocab], filtered tokens at -inf
    """Top-k keeps every token tied with the k-th largest; top-p keeps the smallest prefix whose mass
    reaches p (always at least the top token), over the distribution left by top-k."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, vocab]
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1).clamp(min=0)[:, None])  # [B, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # [B, vocab]: mass of strictly better tokens
        # Rows with top_p == 1 skip the test so float rounding of the cumsum never drops their tail.
        drop = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler(torch.nn.Module):
    """Turns one step's logits into tokens. Called by the model runner once per step.

    Order (as vLLM): raw logprobs (of the unprocessed logits) -> allowed_token_ids -> bans (stop tokens
    before min_tokens, bad_words) -> logit_bias -> plugin logits processors that can change the argmax ->
    penalties -> [greedy rows: argmax] -> temperature -> argmax-invariant plugin processors -> min_p ->
    top_k -> top_p -> exponential race with hash noise. Built-in steps do not modify the input logits
    (a plugin processor may, in place).
    """

    def forward(
        self,
        logits: torch.Tensor,  # [B, vocab] float32 or the model dtype (`Model.compute_logits`)
        meta: SamplingMetadata,
    ) -> SamplerOutput:
        if meta.all_greedy and meta.max_num_logprobs is None and not self.changes_argmax(meta):
            # Every row takes the argmax of its raw logits: the float32 upcast is exact and keeps the order (and
            # the first of equal maxima wins in both), so the tokens are the same without the float32 copy.
            return SamplerOutput(sampled_token_ids=logits.argmax(dim=-1))
        logits = logits.to(torch.float32)
        raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        sampled = self.sample(self.apply_logits_processors(logits, meta), meta)
        if raw_logprobs is None or meta.max_num_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        ids, lps, ranks = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprob_token_ids=ids, logprobs=lps, ranks=ranks)

    @staticmethod
    def changes_argmax(meta: SamplingMetadata) -> bool:
        """Whether `apply_logits_processors` can change a row's argmax this step (any of its steps is on)."""
        return (meta.allowed_token_mask is not None or meta.min_tokens_mask is not None
                or meta.logit_bias is not None or not meta.no_penalties
                or bool(meta.logitsprocs is not None and meta.logitsprocs.non_argmax_invariant))

    def apply_logits_processors(
        self,
        logits: torch.Tensor,  # [B, vocab] float32
        meta: SamplingMetadata,
    ) -> torch.Tensor:  # [B, vocab]
        """The steps that can change the argmax: allowed_token_ids, bans (min_tokens, bad_words),
        logit_bias, plugin processors that are not argmax-invariant, penalties."""
        if meta.allowed_token_mask is not None:
            logits = logits.masked_fill(~meta.allowed_token_mask, float("-inf"))
        if meta.min_tokens_mask is not None:
            logits = logits.masked_fill(meta.min_tokens_mask, float("-inf"))
        if meta.logit_bias is not None:
            logits = logits + meta.logit_bias
        for processor in meta.logitsprocs.non_argmax_invariant if meta.logitsprocs is not None else ():
            logits = processor.apply(logits)
        if not meta.no_penalties:
            logits = apply_penalties(logits, meta)
        return logits

    def filter_logits(
        self,
        logits: torch.Tensor,  # [B, vocab], after apply_logits_processors
        meta: SamplingMetadata,
    ) -> torch.Tensor:  # [B, vocab]: temperature-scaled, filtered tokens at -inf
        """Temperature, argmax-invariant plugin processors, min_p, top_k, top_p for random rows (greedy
        rows are scaled by 1)."""
        temp = torch.where(meta.temperature < _SAMPLING_EPS, 1.0, meta.temperature)
        logits = logits / temp[:, None]
        for processor in meta.logitsprocs.argmax_invariant if meta.logitsprocs is not None else ():
            logits = processor.apply(logits)
        if not meta.no_min_p:
            probs = logits.softmax(dim=-1)
            threshold = meta.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return apply_top_k_top_p(
            logits,
            None if meta.no_top_k else meta.top_k,
            None if meta.no_top_p else meta.top_p,
        )

    def sample(
        self,
        logits: torch.Tensor,  # [B, vocab], after apply_logits_processors
        meta: SamplingMetadata,
    ) -> torch.Tensor:  # [B] int64
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        if meta.all_greedy and greedy is not None:
            return greedy
        # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) draws i with probability p_i; in log
        # space it needs no softmax.
        log_noise = _noise_for(logits.device)(meta.seeds, meta.step, logits.shape[-1])
        scores = self.filter_logits(logits, meta) - log_noise
        sampled = scores.argmax(dim=-1)
        if greedy is None:
            return sampled
        return torch.where(meta.temperature < _SAMPLING_EPS, greedy, sampled)

    def warm_up(self, vocab_size: int, max_num_seqs: int, device: torch.device) -> None:
        """Called by the model runner's startup warm-up (device platforms): the random rows' noise is a
        torch.compile'd kernel, which would otherwise compile in the first step with a sampled row -- a
        stall of seconds under load -- and leave ~200k compiler objects beside the frozen startup heap
        (keel.gc_heap) for every later full collection to walk: on the H200 at 3d8d7e5 one 55-140 ms
        gen-2 pause every ~100 batch-256 steps. One row is a shape of its own (dynamic shapes specialize
        sizes 0 and 1); two or more share one. The compiled graphs are guarded on what the sampling step
        passes: inference mode, and seeds and step as two tensors (one tensor passed as both compiles a
        variant serving never takes)."""
        noise = _noise_for(device)
        with torch.inference_mode():
            for rows in sorted({1, max(2, max_num_seqs)}):
                noise(torch.zeros(rows, dtype=torch.int64, device=device),
                      torch.zeros(rows, dtype=torch.int64, device=device), vocab_size)

    def compute_probs(
        self,
        logits: torch.Tensor,  # [B, vocab] float32, raw
        meta: SamplingMetadata,
    ) -> torch.Tensor:  # [B, vocab] float32
        """The distribution each row samples from (greedy rows: one-hot at their argmax).

        For tests and for rejection sampling of speculative tokens; not on the sampling path.
        """
        processed = self.apply_logits_processors(logits.to(torch.float32), meta)
        probs = self.filter_logits(processed, meta).softmax(dim=-1)
        one_hot = torch.zeros_like(probs).scatter_(1, processed.argmax(dim=-1, keepdim=True), 1.0)
        return torch.where((meta.temperature < _SAMPLING_EPS)[:, None], one_hot, probs)
