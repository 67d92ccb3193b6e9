"""Find a checkpoint, stream its tensors, build a model on its device/dtype and load it strictly.

Called by the model runner at startup: `resolve_model_path` -> `load_model(cls, build, path)`.
Strictness is the point: a checkpoint tensor nobody consumes, a parameter never loaded, or a shape
mismatch raises `WeightLoadError` naming every offender, instead of serving a half-random model.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from keel.models.checkpoint_files import (
    CheckpointError,
    ModelNotFoundError,
    check_json_file,
    local_model_dir,
    one_line,
)
from keel.models.interface import ModelBuildContext
from keel.models.lazy_tensor import LazySafetensor, dtype_of
from keel.models.weights import WeightLoadError
from keel.quantization import prepare_checkpoint

__all__ = ["ModelNotFoundError", "WeightLoadError", "init_dummy_weights", "iterate_safetensors", "load_model",
           "resolve_model_path"]

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local directory holding the checkpoint for `model` (a path or a Hub repo id).

    A Hub id is fetched with `huggingface_hub.snapshot_download` (weights, config, tokenizer files);
    a cached snapshot is used when offline.
    """
    local = local_model_dir(model)
    if local is not None:
        return local
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelNotFoundError(
            f"{model!r} is not a local directory and huggingface_hub is not installed to download it; "
            "pass a local checkpoint directory or `pip install huggingface_hub`"
        ) from None
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=patterns))
    except Exception as first:  # noqa: BLE001 -- hub/network error types differ across versions
        try:
            cached = snapshot_download(
                model, revision=revision, allow_patterns=patterns, local_files_only=True
            )
        except Exception as second:
            raise ModelNotFoundError(
                f"could not find {model!r} locally or download it from the Hugging Face Hub "
                f"({one_line(first)}). If this machine is offline, download the model "
                "elsewhere and pass its local directory."
            ) from second
        return Path(cached)


def _weight_files(path: Path) -> list[Path]:
    for index in (SAFE_INDEX, BIN_INDEX):
        check_json_file(path / index)
    if (path / SAFE_INDEX).is_file():
        index = json.loads((path / SAFE_INDEX).read_text())
        return [path / f for f in sorted(set(index["weight_map"].values()))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if (path / BIN_INDEX).is_file():
        index = json.loads((path / BIN_INDEX).read_text())
        return [path / f for f in sorted(set(index["weight_map"].values()))]
    return sorted(path.glob("*.bin"))


def _lazy(f: Any, name: str) -> Any:
    source = f.get_slice(name)
    dtype = dtype_of(source.get_dtype())
    return f.get_tensor(name) if dtype is None else LazySafetensor.of(source, dtype)


def iterate_safetensors(path: str | Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, CPU tensor) for every tensor of the checkpoint in directory `path`.

    Reads `model.safetensors`, or the shards listed in `model.safetensors.index.json`, or any
    `*.safetensors`; falls back to `*.bin` files (loaded with `weights_only=True`). Tensors are read
    one at a time so peak memory stays near one tensor beyond the model. With `lazy` (the model loader),
    safetensors entries come as `LazySafetensor`s, valid until the next item: a weight loader narrowing
    one to its rank's shard reads only that shard, and one nobody loads on this rank is never read.
    """
    path = Path(path)
    files = _weight_files(path)
    if not files:
        raise WeightLoadError(f"no *.safetensors or *.bin weight files in {path}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise WeightLoadError(
            f"checkpoint index in {path} names missing shard files: {missing}", missing=missing
        )
    for file in files:
        if file.suffix == ".safetensors":
            yield from _read_safetensors(file, lazy)
        else:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 -- pickle, zip and torch errors alike
                raise CheckpointError(f"{file}: not a readable PyTorch weights file ({one_line(exc)})") from None
            yield from state.items()
            del state


def _read_safetensors(file: Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names = list(f.keys())
            for name in names:
                yield name, _lazy(f, name) if lazy else f.get_tensor(name)
    except SafetensorError as exc:
        raise CheckpointError(f"{file}: not a valid safetensors file ({exc}); it is truncated or corrupt") from None


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside get `dtype` (models build in the engine's dtype)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> set[str]:
    """Fill every floating-point parameter with random values (`load_format="dummy"`); returns their names.

    Scales keep activations O(1) through any depth (norm weights 1, biases 0, embeddings N(0, 1),
    matrices N(0, 1/fan_in), fp8 matrices too, with quantization scales 1), so a benchmark on dummy
    weights does the same work as on real ones. A parameter with a `dummy_init(tensor, generator)`
    attribute (4-bit packed weights, group indices) is filled by it.
    """
    names: set[str] = set()
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        init = getattr(p, "dummy_init", None)  # a layout with its own valid values (packed ints, group ids)
        if init is None and not p.dtype.is_floating_point:
            continue
        gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        if init is not None:
            init(p.data, gen)
            names.add(name)
            continue
        if name.endswith(("_scale", "_scale_inv")):  # quantization scales: weights keep their own scale
            p.fill_(1.0)
        elif p.element_size() == 1:  # fp8 storage: no random kernels; draw in float32
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * p.shape[-1] ** -0.5)
        elif name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        elif p.dim() == 2 and "embed" in name:
            p.normal_(0.0, 1.0, generator=gen)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 1.0, generator=gen)
        names.add(name)
    return names


def load_model(model_cls: Any, build: ModelBuildContext, path: str | Path, load_format: str = "auto"
               ) -> nn.Module:
    """Build `model_cls(build)` directly on `build.device` in `build.dtype`, then load `path` strictly.

    With `load_format="dummy"` no weight file is read: parameters get `init_dummy_weights` (only the
    checkpoint's config.json is needed).

    Returns the model in eval mode. Raises `WeightLoadError` for unconsumed checkpoint tensors, shape
    mismatches (from the model's `load_weights`) and parameters the checkpoint never filled. Then
    every module's quantization method (a `quant_method` attribute) gets its one
    `process_weights_after_loading` call, then the model's own `process_weights_after_loading()` if
    it has one.
    """
    if not build.dtype.is_floating_point:
        raise ValueError(f"model dtype must be a floating point dtype, got {build.dtype}")
    with torch.device(build.device), default_dtype(build.dtype):
        model = model_cls(build)
    if load_format == "dummy":
        loaded = init_dummy_weights(model)
    else:
        loaded = model.load_weights(prepare_checkpoint(build.quant_method, iterate_safetensors(path, lazy=True)))
    missing = sorted(name for name, p in model.named_parameters()
                     if name not in loaded and not getattr(p, "optional", False))
    if missing:
        raise WeightLoadError(
            f"checkpoint {path} did not fill these parameters of {model_cls.__name__} "
            f"(for stacked ones, some shards were absent): {missing}",
            missing=missing,
        )
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    # a layer's input permutation (GPTQ act order) moves into the layer producing that input, where declared
    from keel.layers.linear import fold_input_permutations

    fold_input_permutations(model)
    # a quantized layer's activation quantization moves into the norm / activation producing its input
    from keel.layers.input_quant import bind_input_quant

    bind_input_quant(model)
    # Models that derive tensors from their weights (MLA's absorbed W_UK / W_UV) do it here, after
    # either load path, so dummy weights are processed exactly like checkpoint weights.
    hook = getattr(model, "process_weights_after_loading", None)
    if hook is not None:
        hook()
    return model.eval()
