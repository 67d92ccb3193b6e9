"""Input processing (API side): prompt -> validated EngineCoreRequest(s). n > 1 fans out into children."""

from __future__ import annotations

import numbers
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keel.engine.limits import INT64_MAX, INT64_MIN, ParamError, check_int
from keel.engine.pooling_params import PoolingParams
from keel.engine.prompt_bound import PromptBound, PromptTooLongError
from keel.engine.request import EngineCoreRequest
from keel.engine.sampling_params import SamplingParams


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    cache_salt: str | None = None  # the prompt dict's `cache_salt` (vLLM's): mixed into its prefix hashes


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


class Processor:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, eos_token_id: int | None,
                 seed: int = 0, generation_config: Mapping[str, Any] | None = None,
                 structured_output_backend: Callable[[], type] | None = None,
                 scheduling_policy: str = "fcfs", logits_processors: Sequence[type] = (),
                 max_logprobs: int = -1) -> None:
        self.tokenizer = tokenizer
        self.scheduling_policy = scheduling_policy
        # The engine's logits processor classes: each validates every request's params (extra_args).
        self.logits_processors = tuple(logits_processors)
        self.max_logprobs = max_logprobs  # ModelConfig.max_logprobs; -1: the vocabulary size
        self.generation_config = dict(generation_config or {})  # ModelConfig.generation_config_fields
        # Loads the `structured_output` backend class (imported on first use), or None.
        self.structured_output_backend = structured_output_backend
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._bound = PromptBound(tokenizer, max_model_len)
        self._rng = random.Random(seed)

    def process_prompt(self, prompt: str | Mapping[str, Any] | list[int]) -> ProcessedPrompt:
        salt = None
        if isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, Mapping):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise ValueError(f"unknown prompt field(s) {sorted(unknown)}; use 'prompt' or 'prompt_token_ids' "
                                 "(and optionally 'cache_salt')")
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            salt = prompt.get("cache_salt")
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise ParamError("cache_salt", "cache_salt must be a non-empty string")
        elif isinstance(prompt, list) and (_all_ints(prompt) or all(isinstance(t, int) for t in prompt)):
            text, ids = None, prompt
        else:
            raise TypeError(f"a prompt is a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")
        if ids is None:
            if text is None:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; with skip_tokenizer_init=True pass prompt_token_ids")
            ids = self._bound.encode(text)
        ids = self._checked_token_ids(ids)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}: it must be "
                f"shorter to leave room for at least one generated token"
            )
        return ProcessedPrompt(text, ids, salt)

    def _checked_token_ids(self, ids: Any) -> list[int]:
        """The prompt's ids as a new list of Python ints in [0, vocab_size), or a ParamError.

        A list of plain ints (the common case) is checked by C-level passes (types, min, max): a
        per-token Python loop cost ~0.2 ms per 128-token prompt, ~2 ms per 3000-token one.
        """
        if isinstance(ids, list) and ids and _all_ints(ids):
            if min(ids) >= 0 and max(ids) < self.vocab_size:
                return list(ids)
        # numpy / torch integers are fine (tokenizers return them); floats and bools are not.
        elif isinstance(ids, (str, bytes)) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
            raise ParamError("prompt", "prompt token ids must be a list of integers")
        ids = [int(t) for t in ids]
        if not ids:
            raise ParamError("prompt", "the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ParamError("prompt", f"prompt token id(s) {_ids(bad)} out of vocabulary range [0, {self.vocab_size})")
        return ids

    def check_token_ids(self, params: SamplingParams) -> None:
        """Token ids inside sampling params must exist in the vocabulary, and no more logprobs than the
        vocabulary holds can be asked for. Checked here, before anything is queued: found later, inside
        an engine step, the error would fail the whole batch."""
        for field in ("logprobs", "prompt_logprobs"):
            k = getattr(params, field)
            if k is not None and k > self.vocab_size:
                raise ParamError(field, f"{field} must be at most the vocabulary size {self.vocab_size}, got {k}")
            if k is not None and 0 <= self.max_logprobs < k:
                raise ParamError(field, f"{field} must be at most max_logprobs={self.max_logprobs} (the engine's "
                                        f"--max-logprobs), got {k}")
        for field, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids or ()),
                           ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = sorted(t for t in ids if not 0 <= int(t) < self.vocab_size)
            if bad:
                raise ParamError(field, f"{field}: token id(s) {_ids(bad)} out of vocabulary range [0, {self.vocab_size})")

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """A constraint must be one the backend can compile and the engine can enforce; checked before
        queuing (the backend's own `validate`, which names the problem: HTTP 400 in the server)."""
        constraint = params.structured_outputs
        if constraint is None:
            return
        if self.structured_output_backend is None:
            raise ValueError("structured_outputs needs a structured_output backend plugin "
                             "(e.g. keel-structured-output-xgrammar); none is loaded")
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs the tokenizer (skip_tokenizer_init=True was given)")
        self.structured_output_backend().validate(constraint)

    def check_logits_processor_args(self, params: SamplingParams) -> None:
        """`extra_args` is read by logits processors only: without any it is refused, not ignored; with
        some, each processor's `validate_params` judges the request (a ParamError naming the argument)."""
        if params.extra_args and not self.logits_processors:
            raise ParamError("extra_args", "extra_args are read by logits processors, and this engine has none "
                                           "(start it with logits_processors / --logits-processors)")
        for cls in self.logits_processors:
            try:
                cls.validate_params(params)
            except ParamError:
                raise
            except (ValueError, TypeError) as exc:
                raise ParamError("extra_args", f"{cls.__name__}: {exc}") from None

    def max_tokens(self, params: SamplingParams, prompt_len: int) -> int:
        room = self.max_model_len - prompt_len
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def check_priority(self, priority: int) -> None:
        """vLLM's rule: a priority other than 0 needs the "priority" scheduling policy."""
        check_int("priority", priority, INT64_MIN, INT64_MAX)
        if priority != 0 and self.scheduling_policy != "priority":
            raise ParamError("priority", f"Got priority {priority} but priority scheduling is not enabled "
                                         "(start the engine with scheduling_policy='priority')")

    def make_pooling_request(self, request_id: str, prompt: ProcessedPrompt, params: PoolingParams,
                             arrival_time: float, priority: int = 0) -> EngineCoreRequest:
        """One engine request that computes the prompt and returns its pooled vector (samples nothing)."""
        self.check_priority(priority)
        return EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt.prompt_token_ids,
                                 sampling_params=SamplingParams(max_tokens=1), eos_token_id=None, seed=0,
                                 arrival_time=arrival_time, cache_salt=prompt.cache_salt, priority=priority,
                                 pooling_params=params)

    def make_requests(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                      arrival_time: float, priority: int = 0) -> list[EngineCoreRequest]:
        """One engine request per sample (n); children of a seeded request get distinct derived seeds."""
        self.check_priority(priority)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids with skip_tokenizer_init")
        self.check_token_ids(params)
        self.check_structured_outputs(params)
        self.check_logits_processor_args(params)
        if self.generation_config.get("eos_token_id"):
            # the model's extra end-of-turn ids stop it too (Llama-3.x / Qwen2.5 chat turns end on them);
            # on a copy: the caller's params may serve other requests and engines
            params = params.clone()
            params.update_from_generation_config(self.generation_config, self.eos_token_id)
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer (skip_tokenizer_init=True was given)")
            params = params.clone()  # the user's object stays as given
            params.update_from_tokenizer(self.tokenizer)
        requests = []
        for i in range(params.n):
            if params.seed is not None:
                seed = (params.seed * 1_000_003 + i) & 0x7FFF_FFFF_FFFF_FFFF
            else:
                seed = self._rng.getrandbits(63)
            rid = request_id if params.n == 1 else child_request_id(request_id, i)
            requests.append(
                EngineCoreRequest(
                    request_id=rid,
                    prompt_token_ids=prompt.prompt_token_ids,
                    sampling_params=params,
                    eos_token_id=self.eos_token_id,
                    seed=seed,
                    arrival_time=arrival_time,
                    cache_salt=prompt.cache_salt,
                    priority=priority,
                )
            )
        return requests


def _all_ints(values: list) -> bool:
    """Every element is exactly an int (not a bool or an int subclass): one C-level pass."""
    return set(map(type, values)) <= {int}


def _ids(bad: list[int]) -> str:
    """The first offending ids for a message (an id of thousands of digits is not printed)."""
    return "[" + ", ".join(str(t) if t.bit_length() <= 64 else f"<{t.bit_length()}-bit integer>" for t in bad[:5]) + "]"
