"""`StructuredOutputsParams`: what a request's output must match, as vLLM's class of the same name.

Users set it on `SamplingParams.structured_outputs` (offline) or through the OpenAI fields
`response_format` / `structured_outputs` / `guided_*` (server). Validated on construction: exactly one
constraint, each of the right type. Whether the constraint itself is well-formed (a schema, a regex, a
grammar) is the backend's to say (`StructuredOutputBackend.validate`), before the request is queued.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

# The constraint fields; exactly one is set.
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF-style, `root ::= ...`)
    json_object: bool | None = None  # any JSON object (OpenAI's json_object mode)
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens
    disable_additional_properties: bool = False  # schemas: additionalProperties false unless given
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        set_ = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object "
                f"(and structural_tag), got {set_ or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (object or string), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar", "whitespace_pattern", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {type(value).__name__}")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")

    @classmethod
    def from_dict(cls, raw: Any, where: str = "structured_outputs") -> StructuredOutputsParams:
        """From a mapping (the server's body, a user's dict); unknown keys are an error naming them."""
        if isinstance(raw, cls):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be an object, got {type(raw).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(names)}")
        return cls(**raw)

    @property
    def kind(self) -> str:
        """The constraint set: one of CONSTRAINTS."""
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    @property
    def schema_text(self) -> str | None:
        """The JSON schema as canonical text (`json` only), so equal schemas share a compiled grammar."""
        if self.json is None:
            return None
        if isinstance(self.json, str):
            try:
                return json.dumps(json.loads(self.json), sort_keys=True)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        return json.dumps(self.json, sort_keys=True)

    def cache_key(self) -> tuple[Any, ...]:
        """Equal keys compile to the same grammar (the manager's cache key)."""
        kind = self.kind
        value = self.schema_text if kind == "json" else getattr(self, kind)
        return (kind, value, self.disable_any_whitespace, self.disable_additional_properties,
                self.whitespace_pattern)
