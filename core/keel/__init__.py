"""keel: a plugin-first microkernel for LLM inference and serving.

The public API mirrors vLLM's (`LLM`, `SamplingParams`, `RequestOutput`, `EngineArgs`, `TokensPrompt`, ...). Names are imported lazily so
that `import keel` (done by every plugin manifest at discovery) stays cheap: no torch until needed.
"""

from keel.version import CORE_API_VERSION, __version__

_LAZY = {
    "LLM": "keel.engine.llm",
    "SamplingParams": "keel.engine.sampling_params",
    "RequestOutput": "keel.engine.outputs",
    "CompletionOutput": "keel.engine.outputs",
    "Logprob": "keel.engine.outputs",
    "EngineArgs": "keel.engine_args",
    "AsyncEngineArgs": "keel.engine_args",
    "AsyncLLM": "keel.engine.async_llm",
    "TextPrompt": "keel.inputs",
    "TokensPrompt": "keel.inputs",
    "BeamSearchParams": "keel.engine.beam_search",
}

__all__ = [
    "CORE_API_VERSION",
    "LLM",
    "AsyncEngineArgs",
    "AsyncLLM",
    "BeamSearchParams",
    "TextPrompt",
    "TokensPrompt",
    "CompletionOutput",
    "EngineArgs",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'keel' has no attribute {name!r}")
