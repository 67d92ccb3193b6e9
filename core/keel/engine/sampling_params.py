"""`SamplingParams`: how one request's tokens are chosen, mirroring vLLM's class field for field.

Users build it (directly or through the OpenAI endpoint); the engine validates it once at construction
and never mutates it afterwards except through `update_from_generation_config`, which the engine calls
once when the request is added. The model runner turns a batch of them into a `SamplingMetadata`.
"""

from __future__ import annotations

import copy
import enum
import logging
from dataclasses import dataclass, field
from typing import Any

from keel.engine.limits import (
    FLOAT32_MAX,
    INT64_MAX,
    LOGIT_BIAS_MAX,
    ParamError,
    check_float,
    check_int,
    is_int,
)
from keel.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-5
# Positive temperatures below this overflow float32 logits / temperature; vLLM clamps them too.
_MAX_TEMP = 1e-2


class SamplingType(enum.IntEnum):
    """How the sampler picks a request's token: argmax, random, or random from a user seed."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """Sampling parameters for text generation; names, defaults and meaning follow vLLM.

    Guarantees after construction: every field is validated (a bad value raises `ValueError` naming
    the field), `stop` and `stop_token_ids` are lists, `top_k` is 0 when disabled (-1 is accepted and
    normalized), and a greedy request (temperature < 1e-5) has top_p=1, top_k=0, min_p=0.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    # What the output must match (JSON schema, regex, choice, grammar); a dict is converted.
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # words never to generate (tokenized by the front end)
    # Arguments for the engine's logits processors (vLLM's extra_args; the server's vllm_xargs)
    extra_args: dict[str, Any] | None = None

    # Derived; not constructor arguments.
    output_text_buffer_length: int = field(default=0, init=False)
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, (list, tuple, set)):
            self.stop_token_ids = list(self.stop_token_ids)
        elif self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1 and is_int(self.top_k):
            self.top_k = 0
        self._verify_args()
        if _SAMPLING_EPS <= self.temperature < _MAX_TEMP:
            logger.warning(
                "temperature %s is below %s and may overflow float32 logits; using %s",
                self.temperature, _MAX_TEMP, _MAX_TEMP,
            )
            self.temperature = _MAX_TEMP
        if self.temperature < _SAMPLING_EPS:
            # Filters cannot change an argmax; resetting them lets the sampler skip their work.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        if self.stop and not self.include_stop_str_in_output:
            # The detokenizer holds back this many characters, since they may begin a stop string.
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _verify_args(self) -> None:
        """Types and ranges of every field (ParamError, a ValueError naming the field). Integers must fit
        the int64 rows of the persistent batch, floats float32 logits (`keel.engine.limits`)."""
        check_int("n", self.n, 1, what="an integer of at least 1")
        check_float("presence_penalty", self.presence_penalty, -2.0, 2.0, what="in [-2, 2]")
        check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0, what="in [-2, 2]")
        check_float("repetition_penalty", self.repetition_penalty, 0.0, FLOAT32_MAX, lo_open=True,
                    what=f"greater than zero and at most {FLOAT32_MAX:.4g}")
        check_float("temperature", self.temperature, 0.0, FLOAT32_MAX,
                    what=f"non-negative and finite (at most {FLOAT32_MAX:.4g})")
        check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True, what="in (0, 1]")
        check_int("top_k", self.top_k, 0, what=f"0 or -1 (disable), or in [1, {INT64_MAX}]")
        check_float("min_p", self.min_p, 0.0, 1.0, what="in [0, 1]")
        if self.seed is not None and not is_int(self.seed):  # any int: the engine keeps its low 64 bits
            raise ParamError("seed", f"seed must be an integer or None, got {self.seed!r}.")
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, 1, what=f"at least 1 (and at most {INT64_MAX})")
        check_int("min_tokens", self.min_tokens, 0, what=f"greater than or equal to 0 (and at most {INT64_MAX})")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError("min_tokens", f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                                           f"got {self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 0, what=f"a non-negative integer (at most {INT64_MAX}) or None")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ParamError("stop", f"stop must contain only non-empty strings, got {self.stop!r}.")
        if not isinstance(self.stop_token_ids, list):
            raise ParamError("stop_token_ids", f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}.")
        for t in self.stop_token_ids:
            check_int("stop_token_ids", t, 0, what=f"a list of non-negative integers (at most {INT64_MAX})")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise ParamError("allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids, "
                                                      f"got {self.allowed_token_ids!r}.")
            self.allowed_token_ids = list(self.allowed_token_ids)
            for t in self.allowed_token_ids:
                check_int("allowed_token_ids", t, 0, what=f"a list of non-negative integers (at most {INT64_MAX})")
        if self.bad_words is not None and (
                not isinstance(self.bad_words, (list, tuple))
                or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise ParamError("bad_words", f"bad_words must be a list of non-blank strings, got {self.bad_words!r}.")
        if self.extra_args is not None and (
                not isinstance(self.extra_args, dict) or any(not isinstance(k, str) for k in self.extra_args)):
            raise ParamError("extra_args", f"extra_args must be a mapping with string keys, got {self.extra_args!r}.")
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.structured_outputs is not None:
            try:
                self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
            except ParamError:
                raise
            except (ValueError, TypeError) as exc:
                raise ParamError("structured_outputs", str(exc)) from None

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """The token sequences of `bad_words`, set by `update_from_tokenizer`."""
        return self._bad_words_token_ids

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Called once by the front end for a request with `bad_words` (on its own clone), as vLLM does:
        each word is banned alone and after a space, where that is a different tokenization."""
        self._bad_words_token_ids = []
        for word in self.bad_words or ():
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            self._bad_words_token_ids.append(plain)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced != plain:
                self._bad_words_token_ids.append(spaced)

    @property
    def all_stop_token_ids(self) -> set[int]:
        """`stop_token_ids` plus the EOS ids the engine added; the sampler's min_tokens mask uses it."""
        return self._all_stop_token_ids

    def update_from_generation_config(
        self, generation_config: dict[str, Any], model_eos_token_id: int | None = None
    ) -> None:
        """Called once by the engine when the request is added, as vLLM does.

        The tokenizer's EOS joins `all_stop_token_ids` (the engine stops on it unless `ignore_eos`);
        extra EOS ids of the model's generation config also become ordinary stop tokens.
        """
        if model_eos_token_id is not None:
            self._all_stop_token_ids.add(model_eos_token_id)
        eos_ids = generation_config.get("eos_token_id")
        if eos_ids is None:
            return
        extra = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
        extra.discard(model_eos_token_id)  # type: ignore[arg-type]
        if extra:
            self._all_stop_token_ids.update(extra)
            if not self.ignore_eos:
                extra.update(self.stop_token_ids or ())
                self.stop_token_ids = sorted(extra)

    def clone(self) -> SamplingParams:
        """A deep copy; the front end clones per request it adjusts (generation-config stops, bad words).

        Field by field: scalars and the frozen `structured_outputs` are shared, containers copied (deeply
        where they nest). `copy.deepcopy` of the whole object walked every field through the generic
        reduce protocol: ~45 us per request on a 2-core CPU, ~12 us this way.
        """
        state = dict(self.__dict__)
        for name, value in state.items():
            if type(value) in _CONTAINERS:
                state[name] = type(value)(value) if _flat(value) else copy.deepcopy(value)
        new = object.__new__(type(self))
        new.__dict__.update(state)
        return new


_CONTAINERS = (list, dict, set)  # the mutable field types `clone` copies
_SCALARS = {int, float, str, bool}


def _flat(container: list | dict | set) -> bool:
    """Keys and values are all immutable scalars: a shallow copy is a deep one."""
    values = container.values() if isinstance(container, dict) else container
    return set(map(type, values)) <= _SCALARS and (
        not isinstance(container, dict) or set(map(type, container)) <= _SCALARS)


def _logit_bias(raw: Any) -> dict[int, float]:
    """`{token id: bias}` with int keys (strings of digits accepted, as from JSON) and biases in
    [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX]."""
    what = f"a map of non-negative token ids to numbers in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]"
    if not isinstance(raw, dict):
        raise ParamError("logit_bias", f"logit_bias must be {what}, got {type(raw).__name__}.")
    out: dict[int, float] = {}
    for key, value in raw.items():
        tid = int(key) if isinstance(key, str) and key.isdecimal() and len(key) <= 20 else key
        check_int("logit_bias", tid, 0, what=what)
        check_float("logit_bias", value, -LOGIT_BIAS_MAX, LOGIT_BIAS_MAX, what=what)
        out[tid] = float(value)
    return out
