"""keel-io-processors: OpenAI-compatible request/response processors for keel's API server.

Registered under the `io_processor` kind: "completion" (/v1/completions) and "chat"
(/v1/chat/completions, rendered with the model's chat template). An `io_processor` registry entry is a
factory called by the API server with keyword arguments `tokenizer`, `served_model_name` and
`max_model_len` (factories accept and ignore keywords they do not know, so the server may pass more;
the chat processor also reads `plugin_options` and `plugin_set`, for its `reasoning_parser`).

This module is the entry point and is imported at discovery: it must import nothing heavy.
"""

from keel.plugins.manifest import PluginManifest

__version__ = "0.1.0"


def manifest() -> PluginManifest:
    return PluginManifest(
        name="io-processors",
        version=__version__,
        core_api=">=1.0,<2",
        provides={
            "io_processor": {
                "completion": "keel_io_processors.completion:CompletionProcessor",
                "chat": "keel_io_processors.chat:ChatProcessor",
            }
        },
        hooks=("keel_io_processors.hooks:hooks",),
        description="OpenAI completion and chat request/response processors",
    )
