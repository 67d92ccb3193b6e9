"""A server with `reasoning_parser` deepseek_r1, driven by the official openai client: the answer's
reasoning_content and content, whole and streamed. Structured outputs force the model's text (a random
model would never write the tags), so the split is known exactly."""

from __future__ import annotations

import openai
import pytest

from keel.config import EngineArgs

pytest.importorskip("keel_endpoints")
from keel_endpoints.server import build_app  # noqa: E402
from keel_endpoints.testing import make_tiny_model, serve_in_thread  # noqa: E402

FORCED = {"structured_outputs": {"regex": "plan A</think>Paris"}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("model"))
    args = EngineArgs(model=str(path), profile="cpu", max_model_len=128, num_kv_blocks=64, max_num_seqs=8,
                      plugin_options={"reasoning_parser": "deepseek_r1"})
    with serve_in_thread(args, served_model_name="m") as s:
        yield s


def test_reasoning_split_whole_and_streamed(served):
    client = openai.OpenAI(base_url=served.base_url, api_key="x", max_retries=0)
    kw = {"model": "m", "messages": [{"role": "user", "content": "Capital?"}], "max_tokens": 40,
          "temperature": 0, "extra_body": FORCED}
    message = client.chat.completions.create(**kw).choices[0].message
    assert (message.reasoning_content, message.content) == ("plan A", "Paris")
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (reasoning, content) == ("plan A", "Paris")


def test_unknown_parser_stops_startup(served):
    config = served.engine.config
    bad = type("C", (), {"model": config.model, "plugin_options": {"reasoning_parser": "nope"},
                         "plugin_set": config.plugin_set})()
    with pytest.raises(ValueError, match="reasoning_parser 'nope'.*deepseek_r1"):
        build_app(served.engine, bad, plugin_set=config.plugin_set())
