"""The checkpoint's `generation_config.json`: default sampling settings and extra end-of-sequence ids.

Instruct checkpoints end a chat turn on an id that is not the tokenizer's EOS (Llama-3.x-Instruct's
`<|eot_id|>`, Qwen2.5's `<|im_end|>`): their `generation_config.json` lists every such id under
`eos_token_id`, and the engine stops on all of them. Its sampling fields become the defaults of requests
that leave them unset, as vLLM does (`--generation-config auto`, its default); `vllm` (or `none`) ignores
the file, and a folder path reads that folder's file instead of the model's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FILE_NAME = "generation_config.json"
IGNORE = ("vllm", "none")
# generation_config.json field -> SamplingParams field: the ones vLLM applies as request defaults.
DEFAULT_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


class GenerationConfigError(ValueError):
    """generation_config.json is unreadable or holds a value of the wrong type (names file and field)."""


def read_generation_config(source: str, model_dir: str | Path | None) -> dict[str, Any]:
    """The fields keel uses (`eos_token_id` and DEFAULT_FIELDS) from the file `source` names, else {}.

    Called once per engine by `ModelConfig.generation_config_fields`. A missing file is no error (most
    base checkpoints have none); a file that is not JSON, or a field of the wrong type, is.
    """
    if source in IGNORE:
        return {}
    folder = model_dir if source == "auto" else source
    if folder is None:
        return {}
    path = Path(folder) / FILE_NAME
    if not path.is_file():
        if source != "auto":
            raise GenerationConfigError(f"generation_config {source!r}: no {FILE_NAME} in that folder")
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GenerationConfigError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(raw, dict):
        raise GenerationConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    out: dict[str, Any] = {}
    eos = raw.get("eos_token_id")
    if eos is not None:
        ids = [eos] if isinstance(eos, int) else eos
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                for i in ids):
            raise GenerationConfigError(f"{path}: eos_token_id must be an id or a list of ids, got {eos!r}")
        out["eos_token_id"] = list(ids)
    for field in DEFAULT_FIELDS:
        value = raw.get(field)
        if value is None:
            continue
        integer = field in ("top_k", "max_new_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise GenerationConfigError(f"{path}: {field} must be a{'n integer' if integer else ' number'}, "
                                        f"got {value!r}")
        out[field] = value
    return out


def default_sampling_overrides(fields: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword arguments for the defaults the generation config sets (maybe empty)."""
    return {DEFAULT_FIELDS[k]: v for k, v in fields.items() if k in DEFAULT_FIELDS}
