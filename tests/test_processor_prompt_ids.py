"""Processor.process_prompt's token-id checks: the C-level fast path for lists of ints and the general
path (numpy / torch integers, wrong types, out-of-range ids) accept and refuse exactly the same prompts."""

from __future__ import annotations

import numpy as np
import pytest

from keel.engine.limits import ParamError
from keel.engine.processor import Processor


@pytest.fixture
def processor() -> Processor:
    return Processor(tokenizer=None, max_model_len=64, vocab_size=50, eos_token_id=None)


@pytest.mark.parametrize("form", ["list", "dict"])
def test_plain_ints_pass_as_a_new_list(processor: Processor, form: str) -> None:
    ids = [0, 7, 49]
    out = processor.process_prompt(ids if form == "list" else {"prompt_token_ids": ids}).prompt_token_ids
    assert out == ids and out is not ids


@pytest.mark.parametrize("ids", [np.array([1, 2, 3]), [np.int64(1), 2, 3], (1, 2, 3)])
def test_other_integer_types_become_python_ints(processor: Processor, ids) -> None:
    out = processor.process_prompt({"prompt_token_ids": ids}).prompt_token_ids
    assert out == [1, 2, 3] and all(type(t) is int for t in out)


@pytest.mark.parametrize("ids, message", [
    ([1, 50], r"\[50\] out of vocabulary range \[0, 50\)"),
    ([-1, 3, 60], r"\[-1, 60\] out of vocabulary range"),
    ([1, True], "must be a list of integers"),
    ([1, 2.0], "must be a list of integers"),
    ([], "the prompt is empty"),
    ("abc", "must be a list of integers"),
])
def test_bad_ids_are_refused_naming_them(processor: Processor, ids, message: str) -> None:
    with pytest.raises(ParamError, match=message):
        processor.process_prompt({"prompt_token_ids": ids})


def test_a_list_prompt_with_a_bool_is_refused(processor: Processor) -> None:
    with pytest.raises(ParamError, match="must be a list of integers"):
        processor.process_prompt([1, True])
    with pytest.raises(TypeError, match="a prompt is a string or a dict"):
        processor.process_prompt([1, 2.0])


def test_too_long_is_refused(processor: Processor) -> None:
    with pytest.raises(ValueError, match="max_model_len is 64"):
        processor.process_prompt(list(range(40)) + list(range(24)))
