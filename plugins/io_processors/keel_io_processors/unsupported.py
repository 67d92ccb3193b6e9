"""Request fields OpenAI or vLLM define that this server does not act on: each is a 400 naming it.

Unknown fields stay accepted (clients send extras), but a field whose meaning we know and do not honour
must never be silently dropped -- a JSON-mode client getting free text with HTTP 200 is worse than an
error. A field leaves this table when it is implemented (and declared on the request model).
"""

from __future__ import annotations

from typing import Any

from keel_io_processors.protocol import InvalidRequestError

# field -> what it asks for (for the message); both endpoints.
_COMMON = {
    "structural_tag": "structured outputs",
    "logits_processors": "logits processors",
}
# chat only.
_CHAT = {
    "functions": "function calling",
    "function_call": "function calling",
    "reasoning_effort": "reasoning",
    "include_reasoning": "reasoning",
}


def check_unsupported(request: Any, chat: bool) -> None:
    """Called by `validate` on every parsed body; InvalidRequestError for the first such field set
    (a null value counts as unset)."""
    extra = request.model_extra or {}
    table = {**_COMMON, **_CHAT} if chat else _COMMON
    for name, what in table.items():
        if extra.get(name) is not None:
            raise InvalidRequestError(
                f"{name} is not supported by this server ({what} is not implemented); remove the field",
                name)
