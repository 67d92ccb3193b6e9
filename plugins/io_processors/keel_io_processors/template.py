"""Chat templates rendered under a time and size budget, in Jinja's immutable sandbox.

A chat template is a program: `{% for i in range(10**5) %}{% for j in range(10**5) %}...` runs for
minutes, `{{ 'x' * 10**9 }}` allocates a gigabyte in one step. transformers renders without limits,
so the chat processor renders here instead, with transformers' environment rebuilt (same options,
filters, globals; `test_template_budget.py` checks the output is identical) plus
- a deadline, checked on every line the compiled template executes (a trace function limited to the
  template's own frames) and on every call it makes;
- a size budget checked *before* each operation that can grow a value (`*`, `+`, `**`, `%`, `~`,
  joins, padding widths, filters and method calls with large integer arguments) and after it, and on
  the output as it is produced.
Running over either is a `TemplateBudgetError` (HTTP 400). The sandbox itself is Jinja's.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.filters
import jinja2.nodes
import jinja2.utils
import markupsafe
from jinja2.sandbox import ImmutableSandboxedEnvironment

from keel.io import RequestLimits
from keel_io_processors.protocol import InvalidRequestError

_TEMPLATE_FILE = "<template>"  # co_filename of code compiled from a string
_CHECK_EVERY = 64  # trace ticks between clock reads
_DIGITS = re.compile(r"\d+")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message
# Variables the renderer sets; chat_template_kwargs may not.
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class TemplateBudgetError(InvalidRequestError):
    """A rendering ran past its time or size budget (HTTP 400)."""


class _Budget:
    def __init__(self, limits: RequestLimits) -> None:
        self.max_chars = limits.chat_template_max_chars
        self.timeout = limits.chat_template_timeout_s
        self.deadline = time.monotonic() + self.timeout
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks % _CHECK_EVERY == 0 and time.monotonic() > self.deadline:
            raise TemplateBudgetError(
                f"the chat template ran past its time budget of {self.timeout:g} s", "messages")

    def size(self, n: int, what: str = "a value") -> None:
        if n > self.max_chars:
            raise TemplateBudgetError(
                f"the chat template would build {what} of {n} items, past its size budget of {self.max_chars}",
                "messages")

    def result(self, value: Any) -> Any:
        if isinstance(value, (str, bytes, list, tuple, dict)):
            self.size(len(value))
        return value

    def args(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Integer arguments (widths, counts, repeats) larger than the budget never reach a call."""
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.max_chars:
                raise TemplateBudgetError(
                    f"the chat template passes {a if a.bit_length() < 64 else 'a huge integer'} to a function, "
                    f"past its size budget of {self.max_chars}", "messages")

    def widths(self, fmt: Any) -> None:
        """Format strings: a width like '{:>1000000000}' or '%0999999999d' is refused before formatting."""
        if isinstance(fmt, str):
            for digits in _DIGITS.findall(fmt):
                if len(digits) > 9 or int(digits) > self.max_chars:
                    raise TemplateBudgetError("the chat template formats with a width past its size budget",
                                              "messages")


_local = threading.local()


def _budget() -> _Budget:
    budget = getattr(_local, "budget", None)
    if budget is None:  # compiled code runs only inside render_chat_template
        raise TemplateBudgetError("a chat template ran outside a rendering budget", "messages")
    return budget


def _length(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else len(str(value))


def _joined(parts: Any) -> str:
    """`concat`, `~` and `join`: the size is checked before the string is built."""
    budget = _budget()
    parts = list(parts)
    budget.size(sum(_length(p) for p in parts), "a string")
    return "".join(str(p) for p in parts)


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}` block (it marks assistant text for training masks); rendering
    only needs its body."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment, with every growing operation checked against the
    budget of the rendering in progress on this thread."""

    intercepted_binops = frozenset({"+", "*", "**", "%", "//", "/", "-"})
    concat = staticmethod(_joined)

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.filters = {name: _checked(f, name) for name, f in self.filters.items()}
        self.filters["tojson"] = _checked(_tojson)
        self.filters["join"] = _checked(_join_filter)
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                            dict=_TemplateDict(), namespace=_TemplateNamespace)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    budget.size(len(seq) * max(n, 0), "a repeated value")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            budget.size(len(left) + len(right), "a concatenation")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            budget.size(max(right, 0) * left.bit_length() // 3, "a power with digits")  # ~digits
        elif operator == "%" and isinstance(left, str):
            budget.widths(left)
            budget.args(right if isinstance(right, tuple) else (right,), {})
        return budget.result(super().call_binop(context, operator, left, right))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        budget.args(args, kwargs)
        method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
        owner = getattr(method, "__self__", None)
        name = getattr(method, "__name__", "")
        if isinstance(owner, str):
            if name == "join" and args:
                items = list(args[0])
                budget.size(len(owner) * len(items) + sum(_length(i) for i in items), "a joined string")
                args = (items, *args[1:])
            elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                count = owner.count(args[0]) if args[0] else len(owner) + 1
                budget.size(len(owner) + count * len(args[1]), "a replaced string")
            elif name in ("format", "format_map"):
                budget.widths(owner)
        return budget.result(super().call(context, obj, *args, **kwargs))


def _checked(f: Callable[..., Any], name: str = "") -> Callable[..., Any]:
    """A filter whose arguments and result are checked; the value filtered is arguments[0], after the
    context Jinja passes to pass_context / pass_eval_context filters."""
    value_at = 1 if hasattr(f, "jinja_pass_arg") else 0

    @functools.wraps(f)  # keeps jinja's pass_context / pass_eval_context marker
    def filter_(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        budget.args(args[value_at + 1:], kwargs)
        if name == "format" and len(args) > value_at:
            budget.widths(args[value_at])
        return budget.result(f(*args, **kwargs))

    return filter_


@jinja2.pass_eval_context
def _join_filter(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    items = list(value)
    _budget().size(len(d) * len(items) + sum(_length(i) for i in items), "a joined string")
    return jinja2.filters.do_join(eval_ctx, items, d, attribute)


# transformers' chat-template globals and filters (chat_template_utils._compile_jinja_template).
def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store {name!r} on a namespace")


_ENV = BudgetedSandbox()


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compiled once per template text; `~` joins go through the budget too."""
    template = _ENV.from_string(source)
    namespace = template.root_render_func.__globals__
    namespace["str_join"] = _joined
    namespace["markup_join"] = lambda parts: markupsafe.Markup(_joined(parts))
    return template


def _trace(frame: Any, event: str, arg: Any) -> Any:
    if frame.f_code.co_filename != _TEMPLATE_FILE:
        return None
    _budget().tick()
    return _trace_lines


def _trace_lines(frame: Any, event: str, arg: Any) -> Any:
    if event == "line":
        _budget().tick()
    return _trace_lines


def render_chat_template(source: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                         continue_final_message: bool, variables: Mapping[str, Any],
                         limits: RequestLimits, tools: list[dict[str, Any]] | None = None) -> str:
    """What `tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False, ...,
    **variables)` returns (with `tools=tools`), within `limits`. Called on the tokenizer thread."""
    messages = [dict(m) for m in messages]
    final = None
    if continue_final_message:
        final = messages[-1].get("content")
        if not isinstance(final, str) or "content" not in source:
            raise InvalidRequestError("continue_final_message needs a final message with text content, and a "
                                      "template that renders it", "continue_final_message")
        messages[-1]["content"] = final + _CONTINUE_TAG
    template = compile_template(source)
    budget = _Budget(limits)
    context = {**variables, "messages": messages, "tools": tools, "documents": None,
               "add_generation_prompt": add_generation_prompt}
    previous = sys.gettrace()
    _local.budget = budget
    sys.settrace(_trace)
    try:
        pieces, size = [], 0
        for piece in template.generate(**context):
            size += len(piece)
            budget.size(size, "an output")
            pieces.append(piece)
    except RecursionError:
        raise TemplateBudgetError("the chat template recursed too deeply", "messages") from None
    finally:
        sys.settrace(previous)
        _local.budget = None
    text = "".join(pieces)
    if final is not None:
        text = _cut_at_continue_tag(text, final)
    return text


def _cut_at_continue_tag(text: str, final: str) -> str:
    """transformers' continue_final_message: the text up to where the final message's tag landed."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise InvalidRequestError("continue_final_message is set but the chat template does not render the "
                                  "final message", "continue_final_message")
    loc = text.rindex(tag)
    return text[:loc] if text[loc:loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:loc].rstrip()
