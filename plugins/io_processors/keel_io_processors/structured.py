"""The request's output constraint: OpenAI's `response_format`, vLLM's `structured_outputs` and the older
`guided_*` fields vLLM still accepts -> one `StructuredOutputsParams` (or None).

Read from the body's extra fields (they are not declared on the request models), type-checked here;
whether a schema / regex / grammar is well-formed is the backend's check, before queuing.
"""

from __future__ import annotations

from typing import Any

from keel.structured_output.params import StructuredOutputsParams
from keel_io_processors.protocol import InvalidRequestError

# guided_* name -> StructuredOutputsParams field
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern"}
_BACKENDS = ("auto", "xgrammar")


def _response_format(raw: Any) -> dict[str, Any] | None:
    if not isinstance(raw, dict):
        raise InvalidRequestError("response_format must be an object", "response_format")
    kind = raw.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = raw.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError("response_format.json_schema must be an object", "response_format.json_schema")
        schema = spec.get("schema")
        if schema is None:
            return {"json_object": True}  # a named schema without a body: any JSON object
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format.json_schema.schema must be an object",
                                      "response_format.json_schema.schema")
        return {"json": schema}
    raise InvalidRequestError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "response_format.type")


def structured_outputs(request: Any) -> StructuredOutputsParams | None:
    """Called by `build_sampling_params`; InvalidRequestError (HTTP 400) naming the field on bad input."""
    extra = request.model_extra or {}
    sources: list[tuple[str, dict[str, Any]]] = []
    if extra.get("response_format") is not None:
        spec = _response_format(extra["response_format"])
        if spec is not None:
            sources.append(("response_format", spec))
    if extra.get("structured_outputs") is not None:
        raw = extra["structured_outputs"]
        if not isinstance(raw, dict):
            raise InvalidRequestError("structured_outputs must be an object", "structured_outputs")
        sources.append(("structured_outputs", dict(raw)))
    guided = {field: extra[name] for name, field in _GUIDED.items() if extra.get(name) is not None}
    backend = extra.get("guided_decoding_backend")
    if backend is not None and backend not in _BACKENDS:
        raise InvalidRequestError(f"guided_decoding_backend must be one of {list(_BACKENDS)}, got {backend!r}",
                                  "guided_decoding_backend")
    if guided:
        sources.append((next(n for n in _GUIDED if extra.get(n) is not None), guided))
    if not sources:
        return None
    if len(sources) > 1:
        names = [name for name, _ in sources]
        raise InvalidRequestError(f"only one of {names} may constrain the output", names[1])
    param, spec = sources[0]
    try:
        return StructuredOutputsParams.from_dict(spec, param)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(str(exc), param) from None
