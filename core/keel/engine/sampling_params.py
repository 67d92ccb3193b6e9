"""`SamplingParams`: how one request's tokens are chosen, mirroring vLLM's class field for field.

Users build it (directly or through the OpenAI endpoint); the engine validates it once at construction
and never mutates it afterwards except through `update_from_generation_config`, which the engine calls
once when the request is added. The model runner turns a batch of them into a `SamplingMetadata`.
"""

from __future__ import annotations

import copy
import enum
import logging
import math
from dataclasses import dataclass, field
from typing import Any

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

    # Derived; not constructor arguments.
    output_text_buffer_length: int = field(default=0, init=False)
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if _SAMPLING_EPS <= self.temperature < _MAX_TEMP:
            logger.warning(
                "temperature %s is below %s and may overflow float32 logits; using %s",
                self.temperature, _MAX_TEMP, _MAX_TEMP,
            )
            self.temperature = _MAX_TEMP

        self._verify_args()

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
        def _is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer of at least 1, got {self.n!r}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not self.temperature >= 0.0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be non-negative and finite, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k!r}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}.")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}.")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be a non-negative integer or None, got {self.logprobs!r}.")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0
        ):
            raise ValueError(
                f"prompt_logprobs must be a non-negative integer or None, got {self.prompt_logprobs!r}."
            )
        if any(not isinstance(s, str) or not s for s in self.stop or ()):
            raise ValueError(f"stop must contain only non-empty strings, got {self.stop!r}.")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids or ()):
            raise ValueError(
                f"stop_token_ids must contain only non-negative integers, got {self.stop_token_ids!r}."
            )
        if self.logit_bias is not None:
            bad = [t for t in self.logit_bias if t < 0]
            if bad or any(not math.isfinite(v) for v in self.logit_bias.values()):
                raise ValueError(
                    f"logit_bias must map non-negative token ids to finite floats, got {self.logit_bias!r}."
                )

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

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
        """A deep copy; the engine clones per child request when n > 1."""
        return copy.deepcopy(self)
