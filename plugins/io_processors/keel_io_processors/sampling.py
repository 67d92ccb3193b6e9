"""OpenAI request fields -> keel `SamplingParams`, with errors as HTTP-400 `InvalidRequestError`s."""

from __future__ import annotations

from typing import Any

from keel.engine.sampling_params import SamplingParams
from keel_io_processors.protocol import InvalidRequestError, SamplingFields
from keel_io_processors.structured import structured_outputs


def build_sampling_params(request: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                          prompt_logprobs: int | None = None, **overrides: Any) -> SamplingParams:
    """The request's sampling parameters; `SamplingParams`' own range checks become 400s naming the field.
    `overrides`: fields the caller decides (the chat processor's tool-choice constraint)."""
    if request.truncate_prompt_tokens is not None:
        raise InvalidRequestError("truncate_prompt_tokens is not supported: send a prompt that fits "
                                  "max_model_len", "truncate_prompt_tokens")
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
        "logit_bias": request.logit_bias,  # string keys: SamplingParams turns them into token ids
        "structured_outputs": structured_outputs(request),
        # vLLM extras read from the body's extra fields; SamplingParams checks their types and values.
        "allowed_token_ids": (request.model_extra or {}).get("allowed_token_ids"),
        "bad_words": (request.model_extra or {}).get("bad_words"),
    }
    kwargs.update(overrides)
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(str(exc), getattr(exc, "param", None)) from None
