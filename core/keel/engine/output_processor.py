"""Output processing (API side): engine-core outputs -> RequestOutput, with detokenization, stop
strings and logprob dicts. A stop string found here finishes the request; the caller aborts it in the
engine core so its KV blocks are freed at once."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from keel.engine.core_output import EngineCoreOutput
from keel.engine.detokenizer import IncrementalDetokenizer, decode_token
from keel.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from keel.engine.processor import ProcessedPrompt
from keel.engine.sampling_params import SamplingParams


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output holds everything so far
    DELTA = 1  # every output holds only what is new (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes (offline generate)


def _logprob_dict(tokenizer, ids: list[int], lps: list[float], ranks: list[int]) -> dict[int, Logprob]:
    out: dict[int, Logprob] = {}
    for tid, lp, rank in zip(ids, lps, ranks):
        if tid not in out:
            out[tid] = Logprob(lp, rank, decode_token(tokenizer, tid) if tokenizer is not None else None)
    return out


@dataclass
class _Child:
    index: int
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_text: int = 0


class _Parent:
    def __init__(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, tokenizer,
                 kind: RequestOutputKind, arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.kind = kind
        self.tokenizer = tokenizer
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.num_cached_tokens: int | None = None
        detok = tokenizer is not None and params.detokenize
        self.children = [
            _Child(
                index=i,
                detok=IncrementalDetokenizer.from_sampling_params(tokenizer, prompt.prompt_token_ids, params)
                if detok
                else None,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            for i in range(params.n)
        ]

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, tuple[_Parent, int]] = {}

    def add_request(self, request_id: str, child_ids: list[str], prompt: ProcessedPrompt,
                    params: SamplingParams, kind: RequestOutputKind, arrival_time: float) -> None:
        parent = _Parent(request_id, prompt, params, self.tokenizer, kind, arrival_time)
        self.parents[request_id] = parent
        for i, cid in enumerate(child_ids):
            self.child_to_parent[cid] = (parent, i)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def child_ids(self, request_id: str) -> list[str]:
        return [cid for cid, (p, _) in self.child_to_parent.items() if p.request_id == request_id]

    def abort_request(self, request_id: str) -> tuple[list[str], RequestOutput | None]:
        """Forget a parent request. Returns the engine request ids to abort in the core and the request's
        final output (its unfinished completions with finish_reason "abort", as vLLM's), or ([], None)
        for an unknown or finished id."""
        ids = self.child_ids(request_id)
        for cid in ids:
            del self.child_to_parent[cid]
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return ids, None
        for child in parent.children:
            if child.finish_reason is None:
                child.finish_reason = "abort"
        parent.metrics.finished_time = time.time()
        return ids, self._make_output(parent)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (request outputs to hand out, engine request ids stopped here by a stop string)."""
        touched: dict[str, _Parent] = {}
        ended: set[str] = set()  # parents with a completion that ended here: only those can be finished
        to_abort: list[str] = []
        now = time.time()
        child_to_parent = self.child_to_parent
        for eco in outputs:
            entry = child_to_parent.get(eco.request_id)
            if entry is None:
                continue
            parent, idx = entry
            child = parent.children[idx]
            touched[parent.request_id] = parent
            m = parent.metrics
            new_ids = eco.new_token_ids
            if new_ids:
                if m.first_token_time is None:
                    m.first_token_time = now
                m.last_token_time = now
                m.num_generation_tokens += len(new_ids)
            if parent.num_cached_tokens is None:
                parent.num_cached_tokens = eco.num_cached_tokens
            if eco.new_prompt_logprobs is not None and parent.prompt_logprobs is not None and idx == 0:
                start, *rows = eco.new_prompt_logprobs
                for pos, (ids, lps, ranks) in enumerate(zip(*rows), start):
                    if pos + 1 == len(parent.prompt_logprobs):  # slot 0 is the first token's None
                        parent.prompt_logprobs.append(_logprob_dict(self.tokenizer, ids, lps, ranks))
            if child.detok is None and child.logprobs is None:  # nothing to decode or look up per token
                child.token_ids += new_ids
                stop_str = None
            else:
                stop_str = self._append_tokens(child, eco)
            if stop_str is not None:
                child.finish_reason, child.stop_reason = "stop", stop_str
                if eco.finish_reason is None:
                    to_abort.append(eco.request_id)
            elif eco.finish_reason is not None:
                child.finish_reason, child.stop_reason = eco.finish_reason, eco.stop_reason
            if child.finish_reason is not None:
                child_to_parent.pop(eco.request_id, None)
                ended.add(parent.request_id)

        ready = []
        final_only = RequestOutputKind.FINAL_ONLY
        for rid, parent in touched.items():
            if rid in ended and parent.finished:
                parent.metrics.finished_time = now
                self.parents.pop(rid, None)
            elif parent.kind is final_only:
                continue
            ready.append(self._make_output(parent))
        return ready, to_abort

    def _append_tokens(self, child: _Child, eco: EngineCoreOutput) -> str | None:
        stop_str = None
        lp = eco.new_logprobs
        for j, token in enumerate(eco.new_token_ids):
            child.token_ids.append(token)
            if child.logprobs is not None and lp is not None:
                child.logprobs.append(_logprob_dict(self.tokenizer, lp[0][j], lp[1][j], lp[2][j]))
                child.cumulative_logprob += lp[1][j][0]
            if child.detok is not None:
                # An EOS / stop token id that ends the request is kept in token_ids but not decoded.
                last = j == len(eco.new_token_ids) - 1
                stop_terminated = last and eco.finish_reason == "stop"
                stop_str = child.detok.update([token], stop_terminated=stop_terminated)
                if stop_str is not None:
                    break
        return stop_str

    def _make_output(self, parent: _Parent) -> RequestOutput:
        delta = parent.kind is RequestOutputKind.DELTA
        completions = []
        finished = True  # every completion has ended (parent.finished, computed on the way)
        for child in parent.children:
            ended = child.finish_reason is not None
            finished = finished and ended
            text = child.detok.get_next_output_text(ended, delta) if child.detok is not None else ""
            if delta:
                token_ids = child.token_ids[child.sent_tokens :]
                logprobs = child.logprobs[child.sent_tokens :] if child.logprobs is not None else None
                child.sent_tokens = len(child.token_ids)
            else:
                token_ids, logprobs = list(child.token_ids), child.logprobs
            completions.append(CompletionOutput(child.index, text, token_ids, child.cumulative_logprob, logprobs,
                                                child.finish_reason, child.stop_reason))
        return RequestOutput(parent.request_id, parent.prompt.prompt, parent.prompt.prompt_token_ids,
                             parent.prompt_logprobs, completions, finished, parent.metrics, parent.num_cached_tokens)
