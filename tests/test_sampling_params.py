"""SamplingParams: vLLM defaults, normalization, derived fields and validation messages."""

from __future__ import annotations

import pytest

from keel.engine.sampling_params import SamplingParams, SamplingType


def test_defaults_mirror_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == [] and not p.ignore_eos
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.detokenize and p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.include_stop_str_in_output and p.logit_bias is None
    assert p.sampling_type is SamplingType.RANDOM
    assert p.all_stop_token_ids == set()


def test_normalization() -> None:
    p = SamplingParams(stop="###", stop_token_ids=(7, 9), top_k=-1, max_tokens=None, logit_bias={"5": 1})
    assert p.stop == ["###"] and p.stop_token_ids == [7, 9] and p.top_k == 0 and p.max_tokens is None
    assert p.logit_bias == {5: 1.0}
    assert p.all_stop_token_ids == {7, 9}
    assert SamplingParams(stop=["a", "bcd"]).output_text_buffer_length == 2
    assert SamplingParams(stop=["bcd"], include_stop_str_in_output=True).output_text_buffer_length == 0


def test_sampling_type_and_greedy_resets_filters() -> None:
    g = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert g.sampling_type is SamplingType.GREEDY
    assert (g.top_p, g.top_k, g.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).sampling_type is SamplingType.GREEDY
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0.0, seed=3).sampling_type is SamplingType.GREEDY


def test_tiny_positive_temperature_is_clamped() -> None:
    assert SamplingParams(temperature=1e-4).temperature == pytest.approx(1e-2)


def test_clone_is_deep() -> None:
    p = SamplingParams(stop=["x"], logit_bias={1: 2.0}, seed=5)
    c = p.clone()
    assert c == p and c is not p
    c.stop.append("y")  # type: ignore[union-attr]
    c.logit_bias[2] = 1.0  # type: ignore[index]
    assert p.stop == ["x"] and p.logit_bias == {1: 2.0}


def test_clone_copies_every_container_and_shares_frozen_fields() -> None:
    from keel.structured_output.params import StructuredOutputsParams

    p = SamplingParams(stop_token_ids=[5], allowed_token_ids=[1, 2], extra_args={"k": [1]},
                       structured_outputs=StructuredOutputsParams(regex="a+"))
    p.update_from_generation_config({"eos_token_id": [2, 3]}, model_eos_token_id=2)
    p._bad_words_token_ids = [[7, 8]]
    c = p.clone()
    assert c == p and c.all_stop_token_ids == p.all_stop_token_ids
    c.stop_token_ids.append(9)  # type: ignore[union-attr]
    c._all_stop_token_ids.add(9)
    c._bad_words_token_ids[0].append(9)
    c.extra_args["k"].append(9)  # type: ignore[index]
    c.allowed_token_ids.append(9)  # type: ignore[union-attr]
    assert p.stop_token_ids == [3, 5] and p.all_stop_token_ids == {2, 3, 5}
    assert p._bad_words_token_ids == [[7, 8]] and p.extra_args == {"k": [1]} and p.allowed_token_ids == [1, 2]
    assert c.structured_outputs is p.structured_outputs  # frozen: shared
    e = SamplingParams().clone()  # empty containers are fresh too
    e._all_stop_token_ids.add(1)
    assert SamplingParams().all_stop_token_ids == set()


def test_update_from_generation_config() -> None:
    p = SamplingParams(stop_token_ids=[5])
    p.update_from_generation_config({"eos_token_id": [2, 3]}, model_eos_token_id=2)
    assert p.all_stop_token_ids == {2, 3, 5}
    assert sorted(p.stop_token_ids) == [3, 5]  # type: ignore[arg-type]
    q = SamplingParams(ignore_eos=True)
    q.update_from_generation_config({"eos_token_id": 3}, model_eos_token_id=2)
    assert q.all_stop_token_ids == {2, 3} and q.stop_token_ids == []


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": 1.5}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        # Past the engine's int64 / float32 arrays: an OverflowError inside a step used to stop the engine.
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_tokens": 2**63, "max_tokens": None}, "min_tokens"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"logprobs": 2**63}, "logprobs"),
        ({"prompt_logprobs": 2**63}, "prompt_logprobs"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
        ({"stop_token_ids": ["7"]}, "stop_token_ids"),
        ({"logit_bias": {2**63: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 1e300}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"temperature": 1e39}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 10**400}, "temperature"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"top_p": None}, "top_p"),
        ({"n": True}, "n"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs)


def test_range_errors_carry_the_field_and_describe_huge_values() -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(top_k=10**5000)  # repr() of it would raise
    assert err.value.param == "top_k" and "bits" in str(err.value) and len(str(err.value)) < 200
    assert SamplingParams(top_k=2**63 - 1, seed=2**64 - 1, min_tokens=2**63 - 1, max_tokens=None).top_k == 2**63 - 1


def test_error_message_shows_the_value() -> None:
    with pytest.raises(ValueError, match=r"temperature must be non-negative.*got -1"):
        SamplingParams(temperature=-1)
