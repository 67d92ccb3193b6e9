"""DraftProposer: the protocol of a speculative-decoding method, registered under the `spec_decoder` kind.

The worker builds the proposer once (`cls(ProposerContext)`) when `speculative_config.method` names
it, before the model runner; the runner calls `propose` after every step for every scheduled request
(`max_drafts` 0 for those that sampled nothing, e.g. a prefill chunk), so a model-based proposer sees
every position the target computed. Drafts are tentative: the scheduler gives them KV slots as lookahead
tokens, the next step verifies them all in one forward pass, and rejected ones are rolled back (they
never enter the prefix cache).

A proposer with its own attention layers (an MTP module) exposes them as `attention_layers()`; the runner
then allocates their KV caches like the target's (same block ids, `layer_idx` continuing after the
target's layers) and hands all caches over in `DraftInput.kv_caches`. One with its own model layers
exposes them as `draft_modules()` (nn.Modules); the worker binds custom ops into them as into the target. While spec decoding is on, the
scheduler reserves `num_speculative_tokens` lookahead slots past the scheduled tokens of every running
request, so draft-model writes at positions the target has not computed yet always have a slot.

Verification (worker/model_runner.py) samples the target at every draft position with exactly the
sampling state a non-speculative step would have used (same seed counter, penalties seeing the earlier
drafts), accepts the leading drafts equal to those samples and emits the first differing sample (or a
bonus token when all match). For deterministic drafts this is rejection sampling with a one-hot proposal
-- a draft d is accepted with probability p(d), otherwise a token is drawn from p without d -- so the
output distribution is the target's; for seeded requests outputs are even identical token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer gets at construction. Frozen: fields are only ever added."""

    method: str
    num_speculative_tokens: int
    options: tuple[tuple[str, Any], ...]  # method-specific settings from speculative_config
    model: torch.nn.Module  # the target model
    device: torch.device
    build: Any = None  # the target's ModelBuildContext (config, dtype, block size, backend selection)
    model_path: Any = None  # pathlib.Path of the checkpoint directory (draft weights stored beside the target's)
    load_format: str = "auto"  # the target's: "dummy" means random weights, no file read

    def option(self, name: str, default: Any) -> Any:
        return dict(self.options).get(name, default)


@dataclass(frozen=True)
class DraftInput:
    """Per step, for every scheduled request. Frozen: fields are only ever added.

    Request i computed positions `first_positions[i] ...` at rows `first_rows[i] ...` of
    `hidden_states`; the first `num_valid_positions[i]` of them have a committed next token (all of a
    chunk without drafts; 1 + accepted drafts otherwise), so `token_ids[i][p + 1]` exists for each.
    """

    req_ids: list[str]
    token_ids: list[list[int]]  # committed tokens of each request, including those accepted this step
    max_drafts: list[int]  # drafts wanted per request (0: sampled nothing; capped by max_model_len)
    hidden_states: torch.Tensor | None = None  # [num_tokens, hidden] of this step's target forward
    last_hidden_rows: list[int] | None = None  # per request: row of its last accepted token
    first_positions: list[int] | None = None  # per request: first position computed this step
    first_rows: list[int] | None = None  # per request: its first row in hidden_states
    num_valid_positions: list[int] | None = None  # per request: positions whose next token is committed
    block_ids: list[list[int]] | None = None  # per request: its block table (lookahead slots included)
    block_size: int = 0
    kv_caches: Sequence[torch.Tensor] | None = None  # per attention layer index, the proposer's included
    # Device inputs, for `propose_on_device` (all rows of the step, T tokens, n requests). Under async
    # scheduling `token_ids` may lag them: the host has not seen the previous step's tokens yet.
    positions: torch.Tensor | None = None  # [T] int64: each row's position
    next_token_ids: torch.Tensor | None = None  # [T] int64: the token after each row (its sample where sampled)
    last_valid_rows: torch.Tensor | None = None  # [n] int64: row of each request's last accepted position
    attn_metadata: Any = None  # the step's CommonAttentionMetadata (device tensors as the target used them)
    drafting: torch.Tensor | None = None  # [D] int64: the requests (batch indices) that want drafts
    num_blocks: torch.Tensor | None = None  # [n] int64: block table entries each request holds
    max_model_len: int = 0


@runtime_checkable
class DraftProposer(Protocol):
    """Implements `propose` (host token ids) or `propose_on_device` (device tensors), or both; the
    runner uses `propose_on_device` where present.

    `propose_on_device(batch) -> Tensor [n, num_speculative_tokens] int64` is called once per step, after
    verification and before anything reaches the host, with the device fields of `DraftInput`; rows of
    requests not in `batch.drafting` are ignored (-1 marks "no draft"). With it, async scheduling keeps
    its overlap: the next step's inputs are built on the device. A proposer with `propose` only reads
    committed host tokens, so under async scheduling each step first waits for the previous one (vLLM's
    n-gram proposer has the same need).

    An optional class attribute `cuda_graph_safe = True` says `propose_on_device` reads nothing but the
    `DraftInput` device fields (and the lengths of its lists), allocates no host memory it hands to the
    device, and never syncs: the runner then captures it as CUDA graphs next to the target's verify
    graphs (`worker/draft_graph.py`).
    """

    def propose(self, batch: DraftInput) -> list[list[int]]:
        """Called by the runner after sampling and after the step's tokens reached the host, once per step
        with every scheduled request; returns at most max_drafts[i] draft tokens per request (a list,
        possibly empty, per request)."""
        ...
