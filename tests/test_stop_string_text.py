"""A stop string that does not match never changes the text: not even one that would match the U+FFFD
that undecodable bytes at the end of an output decode to (the end-of-output flush is not searched for
stop strings). Offline, streaming and non-streaming; the output processor on random token streams."""

from __future__ import annotations

import asyncio
import random

import pytest
from transformers import AutoTokenizer

from keel import LLM
from keel.config import EngineArgs
from keel.engine.async_llm import AsyncLLM
from keel.engine.core_output import EngineCoreOutput
from keel.engine.output_processor import OutputProcessor, RequestOutputKind
from keel.engine.processor import ProcessedPrompt
from keel.engine.sampling_params import SamplingParams

FFFD = "\ufffd"
LEAD_BYTE = 171  # the demo tokenizer's byte token "ê" (0xEA), which opens a 3-byte UTF-8 character


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def _process(tokenizer, ids, stop, kind) -> tuple[str, str | None]:
    """Feed `ids` one step at a time (the last one finishing with "length"); returns (text, finish)."""
    op = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=len(ids), stop=stop)
    op.add_request("r", ["r"], ProcessedPrompt(prompt="p", prompt_token_ids=[5, 6, 7]), params, kind, 0.0)
    text, finish = "", None
    for i, token in enumerate(ids):
        eco = EngineCoreOutput("r", [token], finish_reason="length" if i == len(ids) - 1 else None)
        for out in op.process_outputs([eco])[0]:
            c = out.outputs[0]
            text = text + c.text if kind is RequestOutputKind.DELTA else c.text
            finish = c.finish_reason
        if finish is not None:
            break
    return text, finish


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_unmatched_stop_strings_keep_the_text_of_random_streams(tokenizer, kind):
    rng = random.Random(0)
    checked = 0
    for _ in range(150):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 10))]
        plain, finish = _process(tokenizer, ids, None, kind)
        assert finish == "length"
        stops = [FFFD, FFFD * 2, (plain[-1:] or "a") + FFFD, plain[-3:] + "Q", FFFD + (plain[:1] or "b")]
        for stop in stops:
            text, finish = _process(tokenizer, ids, [stop], kind)
            if finish == "length":
                assert text == plain, (ids, stop)  # on main: cut at a match inside the final flush
                checked += 1
            else:
                assert finish == "stop" and text == plain[: plain.index(stop)], (ids, stop)
    assert checked > 300


def test_an_output_ending_mid_character_keeps_its_text_with_a_stop_string(model_dir):
    """The real engine, forced by logit_bias to emit three lead bytes: "\ufffd\ufffd\ufffd" either way."""
    llm = LLM(model=model_dir, profile="cpu", max_model_len=64, num_kv_blocks=16)
    base = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {LEAD_BYTE: 100.0}}
    plain, stopped = (llm.generate(["Hello"], SamplingParams(**base, stop=s), use_tqdm=False)[0].outputs[0]
                      for s in (None, [FFFD]))
    assert plain.text == FFFD * 3 and plain.finish_reason == "length"
    assert (stopped.text, stopped.finish_reason) == (plain.text, "length")  # on main: "" and "length"

    engine = AsyncLLM.from_engine_args(EngineArgs(model=model_dir, profile="cpu", max_model_len=64,
                                                  num_kv_blocks=16))

    async def stream(stop, kind):
        outs = [o async for o in engine.generate("Hello", SamplingParams(**base, stop=stop), f"{stop}{kind}",
                                                 output_kind=kind)]
        text = "".join(o.outputs[0].text for o in outs) if kind is RequestOutputKind.DELTA else outs[-1].outputs[0].text
        return text, outs[-1].outputs[0].finish_reason

    async def run():
        return [await stream(stop, kind) for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY)
                for stop in ([FFFD], [FFFD * 2, "x" + FFFD])]

    try:
        assert asyncio.run(run()) == [(FFFD * 3, "length")] * 4
    finally:
        engine.shutdown()
