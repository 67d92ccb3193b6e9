"""Request fields OpenAI or vLLM define that this server does not act on: each is a 400 naming it.

Unknown fields stay accepted (clients send extras) with a logged warning naming them, as vLLM does, but
a field whose meaning we know and do not honour must never be silently dropped -- a JSON-mode client
getting free text with HTTP 200 is worse than an error. A field leaves this table when it is
implemented (and declared on the request model, or read from the extras: `READ_FROM_EXTRAS`).
"""

from __future__ import annotations

import logging
from typing import Any

from keel_io_processors.protocol import InvalidRequestError

logger = logging.getLogger("keel.io_processors")

# field -> what it asks for (for the message); both endpoints.
_COMMON = {
    "structural_tag": "structured outputs",
    "logits_processors": "per-request logits processors: the server's --logits-processors apply, with "
                         "arguments in vllm_xargs",
    "kv_transfer_params": "KV transfer (disaggregated prefill)",
    "mm_processor_kwargs": "multi-modal inputs",
    "request_id": "client-chosen request ids",
    "store": "stored completions",
    "metadata": "stored completions",
    "service_tier": "service tiers",
    "prediction": "predicted outputs",
}
# completions only.
_COMPLETION = {
    "prompt_embeds": "prompt embeddings",
}
# chat only.
_CHAT = {
    "functions": "function calling",
    "function_call": "function calling",
    "reasoning_effort": "reasoning",
    "include_reasoning": "reasoning",
    "documents": "retrieval documents in chat templates",
    "modalities": "audio output",
    "audio": "audio output",
    "web_search_options": "web search",
}
# Values of a field above that ask for nothing (OpenAI clients send them by default).
_NO_OP = {"store": (False,), "service_tier": ("auto", "default")}
# Fields the processors read from the body's extras rather than declare.
READ_FROM_EXTRAS = frozenset({
    "allowed_token_ids", "bad_words", "response_format", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
    "tools", "tool_choice", "parallel_tool_calls",
})


def check_unsupported(request: Any, chat: bool) -> None:
    """Called by `validate` on every parsed body; InvalidRequestError for the first such field set
    (a null value counts as unset)."""
    extra = request.model_extra or {}
    table = {**_COMMON, **(_CHAT if chat else _COMPLETION)}
    for name, what in table.items():
        value = extra.get(name)
        if value is not None and not any(value == v and type(value) is type(v) for v in _NO_OP.get(name, ())):
            raise InvalidRequestError(
                f"{name} is not supported by this server ({what} is not implemented); remove the field",
                name)
    unknown = sorted(set(extra) - set(table) - READ_FROM_EXTRAS)
    if unknown:
        logger.warning("request %s: the field(s) %s are not known and were ignored", request.request_id or "?",
                       ", ".join(repr(n[:64]) for n in unknown[:16]))
