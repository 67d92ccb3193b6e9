"""Weight-loading building blocks shared by layers and models.

Layers own their loading: every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)`
attribute that knows how to narrow a full checkpoint tensor to this rank's shard and where a stacked
shard (q/k/v, gate/up) goes. Models stay declarative: they list a `stacked_params_mapping` and call
`load_mapped_weights`, which routes names, enforces strictness and reports every problem at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

# (param_name_fragment, checkpoint_name_fragment, shard_id), e.g. (".qkv_proj", ".q_proj", "q").
StackedParamsMapping = Sequence[tuple[str, str, Any]]
WeightLoader = Callable[..., None]


class WeightLoadError(RuntimeError):
    """A checkpoint does not fit the model: unconsumed tensors, missing parameters or wrong shapes.

    The message lists every offending name, so one run shows the whole mismatch.
    """

    def __init__(
        self,
        message: str,
        *,
        unexpected: Sequence[str] = (),
        missing: Sequence[str] = (),
        mismatched: Sequence[str] = (),
    ) -> None:
        super().__init__(message)
        self.unexpected = list(unexpected)
        self.missing = list(missing)
        self.mismatched = list(mismatched)


class WeightShapeError(WeightLoadError):
    """Raised by a `weight_loader` when a (sharded) checkpoint tensor does not fit its parameter slot."""


def check_shape(target: torch.Tensor, loaded: torch.Tensor, what: str = "") -> None:
    """Raise `WeightShapeError` unless `loaded` has exactly the shape of `target`."""
    if tuple(target.shape) != tuple(loaded.shape):
        where = f" ({what})" if what else ""
        raise WeightShapeError(
            f"shape mismatch{where}: parameter slot {tuple(target.shape)}, checkpoint {tuple(loaded.shape)}"
        )


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a whole, unsharded tensor into `param` (dtype converted on copy)."""
    if shard_id is not None:
        raise WeightLoadError(
            f"parameter of shape {tuple(param.shape)} is not stacked; got shard {shard_id!r}"
        )
    check_shape(param, loaded_weight)
    param.data.copy_(loaded_weight)


def set_weight_attrs(param: torch.Tensor, **attrs: Any) -> None:
    """Attach loading metadata (`weight_loader`, `shard_ids`, `output_dim`, ...) to a parameter."""
    for key, value in attrs.items():
        setattr(param, key, value)


def shard_size(total: int, tp_size: int, what: str) -> int:
    """Size of one rank's equal shard of a dimension of `total`; raises if it does not divide."""
    if total % tp_size != 0:
        raise ValueError(f"{what} ({total}) is not divisible by tensor parallel size {tp_size}")
    return total // tp_size


def load_mapped_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: StackedParamsMapping = (),
    skip_substrs: Sequence[str] = (),
) -> set[str]:
    """Route checkpoint tensors to the parameters' weight loaders; return the fully loaded param names.

    Called by a model's `load_weights`. A name containing a `skip_substrs` entry is dropped silently
    (known-harmless entries such as `rotary_emb.inv_freq`). A checkpoint name whose fragment matches a
    `stacked_params_mapping` row goes to the stacked parameter with that shard id. A stacked parameter
    counts as loaded only when every id in its `shard_ids` attribute arrived. Unconsumed names and
    shape mismatches are collected and raised together as one `WeightLoadError`.
    """
    from keel.layers.kv_scales import kv_scale_aliases  # layers import this module

    params = dict(model.named_parameters())
    aliases = kv_scale_aliases(list(params))
    loaded_shards: dict[str, set[Any]] = {}
    unexpected: list[str] = []
    mismatched: list[str] = []
    for ckpt_name, tensor in weights:
        if any(s in ckpt_name for s in skip_substrs):
            continue
        param_name, shard_id = ckpt_name, None
        for param_frag, ckpt_frag, sid in stacked_params_mapping:
            if ckpt_frag in ckpt_name:
                param_name, shard_id = ckpt_name.replace(ckpt_frag, param_frag), sid
                break
        param = params.get(param_name)
        if param is None and param_name in aliases:
            param_name = aliases[param_name]
            param = params[param_name]
        if param is None:
            unexpected.append(ckpt_name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except WeightLoadError as e:
            mismatched.append(f"{ckpt_name}: {e}")
            continue
        loaded_shards.setdefault(param_name, set()).add(shard_id)
    if unexpected or mismatched:
        lines = []
        if unexpected:
            lines.append(f"checkpoint tensors no parameter consumes: {sorted(unexpected)}")
        if mismatched:
            lines.append("shape mismatches:\n  " + "\n  ".join(mismatched))
        raise WeightLoadError(
            "checkpoint does not match the model:\n" + "\n".join(lines),
            unexpected=unexpected,
            mismatched=mismatched,
        )
    loaded: set[str] = set()
    for name, shards in loaded_shards.items():
        expected = getattr(params[name], "shard_ids", None)
        if expected is None or set(expected) <= shards:
            loaded.add(name)
    return loaded
