"""keel-endpoints: the OpenAI-compatible API server.

Registered under the `endpoint` kind:
- "api_server": the server itself (`keel serve` finds it under this key): builds the FastAPI app,
  registers every selected endpoint on it, serves it with uvicorn; as an endpoint it adds /health,
  /version, /v1/models, /tokenize, /detokenize and /metrics.
- "openai": POST /v1/completions and /v1/chat/completions, through the "completion" and "chat"
  IO processors (plugin io-processors).
- "embeddings": POST /v1/embeddings and /pooling, for embedding (pooling) models.
Registered under the `stat_logger` kind: "prometheus", vLLM's metric names under `keel:`.

This module is the entry point and is imported at discovery: it must import nothing heavy.
"""

from keel.plugins.manifest import PluginManifest

__version__ = "0.1.0"


def manifest() -> PluginManifest:
    return PluginManifest(
        name="endpoints",
        version=__version__,
        core_api=">=1.0,<2",
        provides={
            "endpoint": {
                "api_server": "keel_endpoints.server:APIServer",
                "openai": "keel_endpoints.openai:OpenAIEndpoint",
                "embeddings": "keel_endpoints.embeddings:EmbeddingsEndpoint",
            },
            # /metrics renders it; other front ends find it by key (`StatLogger(model_name)`).
            "stat_logger": {"prometheus": "keel_endpoints.prometheus:PrometheusStatLogger"},
        },
        hooks=("keel_endpoints.options:hooks",),  # the `keel serve` flags of ServerConfig
        description="OpenAI-compatible HTTP server: completions, chat, models, tokenize, metrics",
    )
