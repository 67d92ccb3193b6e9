"""A broken checkpoint is one line naming the file and what is wrong with it, not a library traceback.

Called where startup first reads each kind of file: `ModelConfig.hf_config` (the model path and
config.json), `load_tokenizer` (tokenizer files) and `iterate_safetensors` (weights). The CLI prints
`CheckpointError` (a ConfigError) as `keel: error: <message>`, without a traceback.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from keel.config import ConfigError

# Hugging Face Hub repo ids: "name" or "namespace/name" (huggingface_hub's validate_repo_id).
_REPO_ID = re.compile(r"^(?!.*(--|\.\.))[\w.-]{1,96}(/[\w.-]{1,96})?$")
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_VOCAB_FILES = ("tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tiktoken.model")


class CheckpointError(ConfigError):
    """A checkpoint path or file is missing or broken; the message names it."""


class ModelNotFoundError(CheckpointError, FileNotFoundError):
    """The model is neither a local directory nor downloadable from the Hugging Face Hub."""


def one_line(exc: BaseException) -> str:
    """`Type: message` with the message's whitespace (newlines of library errors) collapsed."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def local_model_dir(model: str) -> Path | None:
    """The local checkpoint directory `model` names, or None when it is a Hub repo id to fetch.

    Raises CheckpointError for a local path that does not exist (anything that cannot be a repo id:
    an absolute or ./ path, more than one '/', ...) or is a file."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFoundError(f"model path {model!r} is a file; pass the checkpoint directory")
    if model.startswith(("/", "./", "../", "~")) or not _REPO_ID.match(model):
        raise ModelNotFoundError(f"model path {model!r} does not exist (and it is not a Hugging Face repo id)")
    return None


def check_json_file(path: Path, *, required: bool = False) -> None:
    """A JSON file of the checkpoint that exists must parse; a required one must exist."""
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path}: missing (is {path.parent} a Hugging Face checkpoint directory?)")
        return
    try:
        json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}); the file is truncated or corrupt") from None


def check_config_dir(path: Path) -> None:
    """config.json of a local checkpoint directory exists and is JSON."""
    check_json_file(path / "config.json", required=True)


def check_tokenizer_dir(path: Path) -> None:
    """The tokenizer's JSON files that a local directory holds are JSON, and it holds some tokenizer."""
    for name in TOKENIZER_JSON_FILES:
        check_json_file(path / name)
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", *_VOCAB_FILES)):
        raise CheckpointError(
            f"{path} has no tokenizer (no tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json ...): "
            "pass --tokenizer PATH, or --skip-tokenizer-init to send token ids only")
