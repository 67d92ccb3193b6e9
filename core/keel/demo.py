"""The demo checkpoint: a small random-weight Llama with the locally trained tokenizer.

Nothing can be downloaded in tests or on an offline machine, so `model="demo"` stands for a checkpoint
built here on first use: a `LlamaForCausalLM` (4 layers, hidden 256, 8 query / 4 KV heads, float32)
with random weights from a fixed seed, saved in the Hugging Face layout next to the tokenizer from
`keel.testing.tokenizer.build_tokenizer`. Its text is gibberish; it exists to run the whole engine
(tokenize, schedule, paged attention, sample, detokenize) end to end and to compare against
transformers on the same weights.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

DEMO_MODEL_NAME = "demo"
"""The `model=` value that the engine resolves to `build_demo_checkpoint(default_demo_path())`."""

_MARKER = "keel_demo.json"
# Bump when the architecture, tokenizer or file layout changes, so stale cached builds are rebuilt.
_DEMO_FORMAT = 1

DEMO_CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
DEMO_VOCAB_SIZE = 512


class DemoCheckpointError(RuntimeError):
    """The demo checkpoint cannot be written where asked."""


def default_demo_path() -> Path:
    """Per-user cache directory of the demo checkpoint.

    `$KEEL_CACHE_DIR/demo-llama` if set, else `$XDG_CACHE_HOME/keel/demo-llama`, else
    `~/.cache/keel/demo-llama`.
    """
    root = os.environ.get("KEEL_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "demo-llama"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "keel" / "demo-llama"


def is_demo_model(model: str | os.PathLike[str]) -> bool:
    """True when `model` is the demo shortcut rather than a path or hub name."""
    return str(model) == DEMO_MODEL_NAME


def build_demo_checkpoint(path: str | os.PathLike[str] | None = None, *, seed: int = 0) -> Path:
    """Write the demo checkpoint to `path` (default: `default_demo_path()`) and return the path.

    Idempotent: a complete build with the same seed is left as is. The files are written to a
    temporary sibling directory and renamed into place, so a crash or a concurrent builder never
    leaves a half-written checkpoint. Refuses (DemoCheckpointError) to replace a non-empty directory
    that is not a demo checkpoint. The caller's torch RNG state is left untouched.
    """
    target = Path(path).expanduser() if path is not None else default_demo_path()
    if _is_complete(target, seed):
        return target
    if target.exists() and any(target.iterdir()) and not (target / _MARKER).exists():
        raise DemoCheckpointError(
            f"{target} exists and is not a keel demo checkpoint; pass an empty or new directory"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _write_checkpoint(tmp, seed)
        if _is_complete(target, seed):  # another process finished first
            return target
        if target.exists():
            shutil.rmtree(target)  # a stale or incomplete demo build (it carries our marker)
        try:
            os.replace(tmp, target)
        except OSError:
            if not _is_complete(target, seed):  # lost a race to a builder that then failed
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete(path: Path, seed: int) -> bool:
    marker = path / _MARKER
    if not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if meta.get("format") != _DEMO_FORMAT or meta.get("seed") != seed:
        return False
    return all((path / name).is_file() for name in meta.get("files", []))


def _write_checkpoint(out: Path, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from keel.testing.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(out, vocab_size=DEMO_VOCAB_SIZE)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **DEMO_CONFIG,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.config.dtype = torch.float32  # recorded in config.json so loaders default to float32
    model.save_pretrained(out, safe_serialization=True)
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    meta = {"format": _DEMO_FORMAT, "seed": seed, "files": files}
    (out / _MARKER).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
