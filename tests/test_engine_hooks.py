"""The engine fires every lifecycle hook a plugin can implement, in order, with the documented args."""

from __future__ import annotations

from keel import LLM, SamplingParams
from keel.testing.checkpoints import make_checkpoint

HOOK_BODY = """
from keel.plugins.hookspecs import hookimpl

EVENTS = []


class Hooks:
    @hookimpl
    def keel_worker_init(self, config, rank):
        EVENTS.append(("worker_init", rank))

    @hookimpl
    def keel_engine_start(self, config):
        EVENTS.append(("engine_start", config.model.model is not None))

    @hookimpl
    def keel_request_finished(self, request_id, reason):
        EVENTS.append(("finished", request_id, reason))

    @hookimpl
    def keel_shutdown(self):
        EVENTS.append(("shutdown",))


hooks = Hooks()
"""


def test_lifecycle_hooks_fire(fake_plugins, tmp_path):
    import importlib

    pkg = fake_plugins("hook-spy", body=HOOK_BODY, hooks=("PKG:hooks",))
    path = make_checkpoint("llama", tmp_path / "m")
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=64,
              plugins=["platform-cpu", "attention-torch", "models-llama", "hook-spy"])
    events = importlib.import_module(pkg).EVENTS
    assert events == [("worker_init", 0), ("engine_start", True)]
    llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7]}],
                 SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert sorted(e for e in events if e[0] == "finished") == [("finished", "0", "length"),
                                                               ("finished", "1", "length")]
    llm.shutdown()
    llm.shutdown()
    assert events.count(("shutdown",)) == 1
