"""`--chat-template`: a file, or the template itself, as vLLM's `load_chat_template` reads it."""

from __future__ import annotations

from pathlib import Path

from keel.config import ConfigError

# A value with any of these is template text; without, it is meant as a path.
_TEMPLATE_CHARS = ("{", "}", "\n")


def load_chat_template(value: str) -> str:
    """The template text of `value`: a readable file's content, else `value` if it looks like a template.
    A value that looks like a path but names no file is a ConfigError naming it."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--chat-template {value}: cannot read it: {exc}") from exc
    except ValueError:  # a name too long or with NUL for the OS: not a path, maybe a template
        pass
    if any(c in value for c in _TEMPLATE_CHARS):
        return value
    raise ConfigError(f"--chat-template {value!r} looks like a file path, but no such file exists")
