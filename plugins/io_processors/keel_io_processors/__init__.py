"""keel-io-processors: OpenAI-compatible request/response processors for keel's API server.

Registered under the `io_processor` kind: "completion" (/v1/completions), "chat"
(/v1/chat/completions, rendered with the model's chat template) and "responses" (/v1/responses, OpenAI's
Responses API for text, served through the chat processor). An `io_processor` registry entry is a
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
                "responses": "keel_io_processors.responses:ResponsesProcessor",
            }
        },
        hooks=("keel_io_processors.hooks:hooks",),
        description="OpenAI completion, chat and Responses request/response processors",
    )
