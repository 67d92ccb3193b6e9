"""Request bodies -> JSON values, refusing what the rest of the server must never see (HTTP 400).

`json.loads` alone lets through, or fails with something other than `JSONDecodeError` on: invalid
UTF-8 (it guesses UTF-16/32 and passes encoded surrogates), integers of more than 4,300 digits
(`ValueError`), nesting ~1,000 deep (`RecursionError`), `NaN` / `Infinity` (not JSON; a NaN in a
response cannot even be rendered), and escaped lone surrogates (`"\\ud800"`, which cannot be encoded
back to UTF-8 in a response or by a tokenizer). Each is a 400 here, with an OpenAI error body.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from keel_endpoints.errors import OpenAIError

# Deeper than any OpenAI body (messages -> content parts -> fields is 4); bounds recursion later on
# (pydantic, chat templates, `tojson`).
MAX_JSON_DEPTH = 64


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _check_tree(value: Any) -> None:
    """Depth and strings of a decoded value, without recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                item.encode("utf-8")  # UnicodeEncodeError for a lone surrogate
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        children = list(item.keys()) + list(item.values()) if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children)


def decode_json(raw: bytes) -> Any:
    """`raw` (UTF-8) as a JSON value; OpenAIError(400) naming what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OpenAIError(400, f"the request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        value = json.loads(text, parse_constant=_constant)
        _check_tree(value)
    except UnicodeEncodeError:
        raise OpenAIError(400, "the request body is not valid JSON: a string holds a lone UTF-16 surrogate "
                               "(\\ud800-\\udfff escapes must come in pairs)") from None
    except RecursionError:
        raise OpenAIError(400, f"the request body is not valid JSON: nested deeper than {MAX_JSON_DEPTH} "
                               "levels") from None
    except ValueError as exc:  # JSONDecodeError, the 4,300-digit integer limit, NaN, depth
        reason = str(exc)
        if "integer string conversion" in reason:
            reason = "an integer has more than 4300 digits"
        raise OpenAIError(400, f"the request body is not valid JSON: {reason}") from None
    return value


async def read_json(request: Request) -> Any:
    """The decoded body of `request` (route handlers call it once)."""
    return decode_json(await request.body())


def body_spec(schema: dict[str, Any]) -> dict[str, Any]:
    """An OpenAPI `openapi_extra` declaring a required JSON body of `schema`."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}

