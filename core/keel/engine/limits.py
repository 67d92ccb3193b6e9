"""Ranges of the numbers a request may carry, and the error that names the field out of range.

Every integer and float a request supplies ends up in a numpy / torch array of a fixed dtype (int64
rows of the persistent batch, float32 logits). A value that does not fit must be refused where the
request is built (`SamplingParams`, the front end's `Processor`, the OpenAI request models) -- found
inside an engine step, an `OverflowError` would fail the whole batch and stop the engine loop.
"""

from __future__ import annotations

import math
from typing import Any

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# The largest finite float32: a larger factor turns a logit into inf, and inf - inf into nan.
FLOAT32_MAX = 3.4028234663852886e38
# OpenAI's documented logit_bias range; two biases near FLOAT32_MAX would sum to inf.
LOGIT_BIAS_MAX = 100.0


class ParamError(ValueError):
    """A request field out of range or of the wrong type. `param` names the field (the OpenAI error
    body's `param`); the message starts with it too."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(param: str, value: Any, lo: int, hi: int = INT64_MAX, what: str = "") -> None:
    """`value` is an int in [lo, hi]; else ParamError naming `param` (`what` replaces the default
    description of the range in the message)."""
    if not is_int(value) or not lo <= value <= hi:
        shown = _shown(value)
        raise ParamError(param, f"{param} must be {what or f'an integer in [{lo}, {hi}]'}, got {shown}.")


def check_float(param: str, value: Any, lo: float, hi: float, *, lo_open: bool = False, what: str = "") -> None:
    """`value` is a real number in [lo, hi] (`(lo, hi]` with `lo_open`); NaN and inf never pass."""
    # An int is compared exactly: math.isfinite(10**400) would raise OverflowError.
    finite = is_int(value) or (isinstance(value, float) and math.isfinite(value))
    ok = finite and (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        bracket = "(" if lo_open else "["
        raise ParamError(param, f"{param} must be {what or f'a number in {bracket}{lo}, {hi}]'}, got {_shown(value)}.")


def _shown(value: Any) -> str:
    """The value for a message: a 4,000-digit integer is described, not printed."""
    if is_int(value) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
