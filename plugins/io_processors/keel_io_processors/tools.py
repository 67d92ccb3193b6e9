"""OpenAI tool calling for the chat processor: `tools` / `tool_choice` / `parallel_tool_calls` checked,
turned into a constraint where the choice forces calls, and the parser that reads calls back.

- "none" (the default without tools): plain content; the template still sees the tools (as vLLM).
- "auto" (the default with tools): the model decides; the server's `tool_call_parser` finds the calls.
  Without one configured, "auto" is a 400 (calls would be silently left in the content).
- "required": structured outputs force a JSON array of `{"name", "parameters"}` objects, one of the
  tools each; a named choice forces the function's parameters schema. Both are parsed here, not hoped for.
`parallel_tool_calls: false` keeps at most one call (the array's maxItems; "auto" keeps the first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from keel.tool_parser import ParsedToolCall, ToolParser, calls_from_json_array
from keel_io_processors.protocol import InvalidRequestError


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict[str, Any], ...]  # the OpenAI tool objects, as sent
    choice: str  # "none" | "auto" | "required" | "named"
    name: str | None  # the named function
    parallel: bool

    def parameters(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {"type": "object"}
        raise KeyError(name)

    def constraint(self) -> dict[str, Any] | None:
        """The structured_outputs spec that enforces the choice, or None ("none", "auto")."""
        if self.choice == "named":
            return {"json": self.parameters(self.name)}
        if self.choice != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]},
                                                   "parameters": self.parameters(t["function"]["name"])},
                  "required": ["name", "parameters"]} for t in self.tools]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            array["maxItems"] = 1
        return {"json": array}


def _check_tools(raw: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(raw, list) or not raw:
        raise InvalidRequestError("tools must be a non-empty list of tool objects", "tools")
    names = set()
    for i, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidRequestError(f"tools.{i} must be {{'type': 'function', 'function': {{...}}}}", f"tools.{i}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError(f"tools.{i}.function.name must be a non-empty string", f"tools.{i}.function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidRequestError(f"tools.{i}.function.parameters must be a JSON schema object",
                                      f"tools.{i}.function.parameters")
        if fn["name"] in names:
            raise InvalidRequestError(f"tools.{i}.function.name {fn['name']!r} is not unique", f"tools.{i}")
        names.add(fn["name"])
    return tuple(raw)


def tool_request(request: Any, parser: ToolParser | None) -> ToolRequest | None:
    """Called by the chat processor's parse_request; None when no tools are in play."""
    extra = request.model_extra or {}
    raw_tools, choice = extra.get("tools"), extra.get("tool_choice")
    parallel = extra.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if raw_tools is None:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        return None
    tools = _check_tools(raw_tools)
    name = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise InvalidRequestError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise InvalidRequestError(
            f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}", "tool_choice")
    if choice == "auto" and parser is None:
        raise InvalidRequestError(
            'tool_choice "auto" needs a tool-call parser: start the server with --tool-call-parser '
            "(hermes, qwen3, llama3_json, mistral, deepseek_v3), or use tool_choice \"required\" or a named "
            "function", "tool_choice")
    if choice != "none" and any(extra.get(f) is not None for f in ("response_format", "structured_outputs")):
        raise InvalidRequestError("tools with tool_choice other than 'none' cannot be combined with "
                                  "response_format or structured_outputs", "tool_choice")
    return ToolRequest(tools=tools, choice=choice, name=name, parallel=parallel)


class NamedToolParser(ToolParser):
    """The whole output is the named function's arguments (forced by its schema)."""

    def __init__(self, name: str) -> None:
        super().__init__(None)
        self.name = name

    def parse(self, text: str, final: bool = True) -> tuple[str | None, list[ParsedToolCall]]:
        return None, [ParsedToolCall(self.name, text.lstrip(), final)]


class RequiredToolParser(ToolParser):
    """The output is a JSON array of `{"name", "parameters"}` (forced by the constraint)."""

    def parse(self, text: str, final: bool = True) -> tuple[str | None, list[ParsedToolCall]]:
        body = text.lstrip()
        return None, (calls_from_json_array(body) if body.startswith("[") else [])


def parser_for(tr: ToolRequest, auto: ToolParser | None) -> ToolParser | None:
    """The parser that reads this request's calls back (None: plain content)."""
    if tr.choice == "named":
        return NamedToolParser(tr.name)
    if tr.choice == "required":
        return RequiredToolParser()
    if tr.choice == "auto":
        return auto
    return None

