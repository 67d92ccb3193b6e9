"""What `LLM.generate` and `AsyncLLM.generate` hand back to users: the vLLM output classes.

Names and fields mirror vLLM (`RequestOutput`, `CompletionOutput`, `Logprob`) so code written against
vLLM reads these unchanged. The output processor (API process) builds them from engine-core outputs
after detokenization; they are plain mutable data with no tensors, safe to pickle and to print.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]
"""Why a completion ended: a stop string / stop token / EOS, max_tokens or the context limit, or
an abort by the client. `None` while the completion is still running."""


@dataclass
class Logprob:
    """Log probability of one token, as in vLLM.

    `rank` is the token's 1-based rank in the sampling distribution (1 = most likely); `decoded_token`
    is the token decoded on its own (see `keel.engine.detokenizer.decode_token`), or None when the
    request did not ask for detokenization.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""One dict per generated token: token id -> Logprob (the sampled token plus the top-k)."""

PromptLogprobs = list[dict[int, Logprob] | None]
"""One entry per prompt token; the first is None because the first token has no preceding context."""


@dataclass
class RequestMetrics:
    """Timestamps (seconds, `time.time()` clock) of one request's life, filled by the output processor.

    Every field but `arrival_time` is None until the event happens.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None
    num_generation_tokens: int = 0


@dataclass
class CompletionOutput:
    """One sampled sequence of a request (there are `SamplingParams.n` of them).

    `text` and `token_ids` are either the whole completion so far or only what is new since the last
    output, depending on the request's output kind (cumulative / delta / final-only). `logprobs` is
    None unless the request asked for logprobs; then it holds one dict per token in `token_ids`.
    `stop_reason` is the stop string or stop token id that ended the completion, None for EOS/length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: FinishReason | str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """True once the completion has ended (any finish reason)."""
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
            f"cumulative_logprob={self.cumulative_logprob}, logprobs={self.logprobs}, "
            f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason})"
        )


@dataclass
class RequestOutput:
    """The output of one request: its prompt and its `n` completions.

    `prompt` is None when the request was given as token ids. `prompt_logprobs` is None unless asked
    for; then its first entry is None. `finished` is True on the last output of the request, once every
    completion has a finish reason. `num_cached_tokens` counts prompt tokens served from the prefix
    cache, when the engine reports it.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None
    kv_transfer_params: dict | None = field(default=None, repr=False)

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of the same request into this one (as vLLM's `RequestOutput.add`).

        Called by the engine client when several outputs of one request are pending and only one is
        handed out. With `aggregate=True` (delta outputs) text, token ids and logprobs are appended per
        completion index; otherwise (cumulative outputs) a completion is replaced by its newer version.
        """
        self.finished |= next_output.finished
        self.kv_transfer_params = next_output.kv_transfer_params
        if next_output.metrics is not None:
            self.metrics = next_output.metrics
        if next_output.num_cached_tokens is not None:
            self.num_cached_tokens = next_output.num_cached_tokens
        for nxt in next_output.outputs:
            for i, cur in enumerate(self.outputs):
                if cur.index != nxt.index:
                    continue
                if aggregate:
                    cur.text += nxt.text
                    cur.token_ids = [*cur.token_ids, *nxt.token_ids]
                    if nxt.logprobs:
                        cur.logprobs = [*(cur.logprobs or []), *nxt.logprobs]
                    cur.cumulative_logprob = nxt.cumulative_logprob
                    cur.finish_reason = nxt.finish_reason
                    cur.stop_reason = nxt.stop_reason
                else:
                    self.outputs[i] = nxt
                break
            else:
                self.outputs.append(nxt)

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, prompt_logprobs={self.prompt_logprobs}, "
            f"outputs={self.outputs}, finished={self.finished}, metrics={self.metrics}, "
            f"num_cached_tokens={self.num_cached_tokens})"
        )


@dataclass
class PoolingOutput:
    """A pooling request's result (vLLM's `PoolingOutput`): `data` is the pooled vector, a float32
    tensor `[pooled_size]` (L2-normalized unless the request's PoolingParams said otherwise)."""

    data: Any

    @property
    def embedding(self) -> list[float]:
        """`data` as a list (vLLM's `EmbeddingOutput.embedding`)."""
        return self.data.tolist()


@dataclass
class PoolingRequestOutput:
    """The output of one pooling request (vLLM's name); it has exactly one, final output."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int | None = None
