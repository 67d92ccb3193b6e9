"""OpenAI request fields -> keel `SamplingParams`, with errors as HTTP-400 `InvalidRequestError`s."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from keel.engine.sampling_params import SamplingParams
from keel_io_processors.protocol import InvalidRequestError, SamplingFields
from keel_io_processors.structured import structured_outputs

# Used for a field the request leaves unset and the model's generation config does not set either.
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def build_sampling_params(request: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                          prompt_logprobs: int | None = None,
                          defaults: Mapping[str, Any] | None = None, **overrides: Any) -> SamplingParams:
    """The request's sampling parameters; `SamplingParams`' own range checks become 400s naming the field.

    `defaults` are the model's generation-config defaults (SamplingParams names, as vLLM's
    `--generation-config auto` applies them): they fill fields the request leaves unset, max_tokens too.
    `overrides`: fields the caller decides (the chat processor's tool-choice constraint, best_of's n).
    """
    defaults = defaults or {}

    def unset_or_default(name: str) -> Any:
        value = getattr(request, name)
        return value if value is not None else defaults.get(name, NEUTRAL[name])

    if max_tokens is None:
        max_tokens = defaults.get("max_tokens")
    kwargs: dict[str, Any] = {
        "n": request.n,
        "presence_penalty": request.presence_penalty or 0.0,
        "frequency_penalty": request.frequency_penalty or 0.0,
        **{name: unset_or_default(name) for name in NEUTRAL},
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
        "extra_args": request.vllm_xargs,
    }
    kwargs.update(overrides)
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(str(exc), getattr(exc, "param", None)) from None
