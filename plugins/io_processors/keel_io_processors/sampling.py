"""OpenAI request fields -> keel `SamplingParams`, with errors as HTTP-400 `InvalidRequestError`s."""

from __future__ import annotations

import dataclasses
from typing import Any

from keel.engine.sampling_params import SamplingParams
from keel_io_processors.protocol import InvalidRequestError, SamplingFields

_PARAM_NAMES = {f.name for f in dataclasses.fields(SamplingParams)}


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if raw is None:
        return None
    out: dict[int, float] = {}
    for key, value in raw.items():
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    return out


def build_sampling_params(request: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                          prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's sampling parameters; `SamplingParams`' own range checks become 400s naming the field."""
    kwargs: dict[str, Any] = {
        "n": request.n,
        "presence_penalty": request.presence_penalty or 0.0,
        "frequency_penalty": request.frequency_penalty or 0.0,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "top_k": 0 if request.top_k is None else request.top_k,
        "min_p": 0.0 if request.min_p is None else request.min_p,
        "repetition_penalty": 1.0 if request.repetition_penalty is None else request.repetition_penalty,
        "seed": request.seed,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "ignore_eos": request.ignore_eos,
        "max_tokens": max_tokens,
        "min_tokens": request.min_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs if prompt_logprobs is not None else request.prompt_logprobs,
        "skip_special_tokens": request.skip_special_tokens,
        "spaces_between_special_tokens": request.spaces_between_special_tokens,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "logit_bias": _logit_bias(request.logit_bias),
    }
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        first = message.split(" ", 1)[0]
        raise InvalidRequestError(message, first if first in _PARAM_NAMES else None) from None
