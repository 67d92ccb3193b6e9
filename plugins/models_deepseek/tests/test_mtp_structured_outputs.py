"""Structured outputs with MTP speculative decoding (tiny DeepSeek-V3 + MTP, CPU).

The scheduler keeps only the drafts the grammar accepts, fills one bitmask row per verify position
(advancing the grammar tentatively through the drafts, then rolling it back) and the runner masks every
verify row, so accepted drafts and the bonus token are always valid. Outputs must parse, and equal
decoding without MTP: greedy, and seeded random too (verification by exact coupling).
"""

from __future__ import annotations

import json
import re

import pytest
from deepseek_test_utils import make_mtp_checkpoint, VOCAB

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.testing.fidelity import run_requests
from keel.testing.tokenizer import build_tokenizer

pytest.importorskip("keel_structured_output_xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]},
                   "size": {"type": "object", "properties": {"unit": {"enum": ["cm", "in"]}, "ok": {"type": "boolean"}},
                            "required": ["unit", "ok"], "additionalProperties": False}},
    "required": ["color", "size"],
    "additionalProperties": False,
}
REGEX = r"(cat|dog)-[0-9]{2,4}"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'root ::= term (" + " term)?\nterm ::= [0-9] | "(" [0-9] " * " [0-9] ")"'
GRAMMAR_RE = r"(\d|\(\d \* \d\))( \+ (\d|\(\d \* \d\)))?"


def check(kind: str, text: str) -> None:
    if kind == "json":
        value = json.loads(text)
        assert value["color"] in ("red", "green", "blue") and value["size"]["unit"] in ("cm", "in")
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(GRAMMAR_RE, text), text


CONSTRAINTS = {"json": {"json": SCHEMA, "disable_any_whitespace": True}, "regex": {"regex": REGEX},
               "choice": {"choice": CHOICES}, "grammar": {"grammar": GRAMMAR}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_mtp_checkpoint(tmp_path_factory.mktemp("mtp-so") / "v3")
    build_tokenizer(path, vocab_size=VOCAB)
    return path


def run(path, k: int | None, requests, async_scheduling: bool = False):
    args = {"model": str(path), "dtype": "float32", "block_size": 4, "max_model_len": 160, "seed": 0,
            "async_scheduling": async_scheduling}
    if k:
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
    engine = LLMEngine.from_engine_args(EngineArgs(**args))
    prompts = [engine.tokenizer.encode(prompt) for prompt, _ in requests]
    done = run_requests(engine, prompts, [params for _, params in requests])
    metrics = engine.get_metrics()
    engine.shutdown()
    return [done[str(i)].outputs[0] for i in range(len(requests))], metrics


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_constrained_outputs_with_mtp_are_valid_and_equal_to_mtp_off(ckpt, async_scheduling):
    """With async scheduling a constrained request waits for its in-flight step (its grammar must see
    the tokens, and the scheduler its drafts), so it verifies every other step; the others keep going."""
    requests, kinds = [], []
    for j, (kind, constraint) in enumerate(CONSTRAINTS.items()):
        for temperature, seed in ((0.0, None), (1.0, 11 + j)):
            requests.append((f"Item {j}: ", SamplingParams(max_tokens=80, temperature=temperature, seed=seed,
                                                            structured_outputs=constraint)))
            kinds.append(kind)
    requests.append(("Free text ", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)))
    kinds.append(None)
    with_mtp, metrics = run(ckpt, 2, requests, async_scheduling)
    without, _ = run(ckpt, None, requests)
    for kind, a, b in zip(kinds, with_mtp, without, strict=True):
        assert a.token_ids == b.token_ids
        if kind is not None:
            assert a.finish_reason == "stop", (kind, a.text)
            check(kind, a.text)
    assert metrics["spec_decode_num_accepted_tokens_total"] > 0
