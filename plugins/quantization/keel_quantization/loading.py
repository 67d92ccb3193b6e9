"""Weight loaders for quantized parameters, built on the linear layer's own shard geometry.

A quantized tensor is laid out along the layer's output and input dimensions, but in units: rows of
128-row scale blocks, int32 words of 8 packed 4-bit values, groups of `group_size` inputs. The layer
says where a checkpoint shard goes in elements (`output_shard(shard_id)`, `input_shard()`); these
loaders divide by the unit and copy this rank's slice, so fused layers (qkv, gate_up) and tensor
parallelism need no per-method code. Every mismatch raises `WeightLoadError` naming the tensor.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from keel.models.weights import WeightLoadError, check_shape, set_weight_attrs


def _units(s: Any, unit: int) -> tuple[int, int, int]:
    """(offset, size, full size) of a ShardSlice in units of `unit` elements (a partial last unit counts)."""
    if s.offset % unit:
        raise WeightLoadError(f"shard at offset {s.offset} does not start on a {unit}-element boundary")
    return s.offset // unit, math.ceil(s.size / unit), math.ceil(s.full_size / unit)


def narrow_rank(src: torch.Tensor, dim: int, full: int, rank_index: int, size: int, what: str) -> torch.Tensor:
    if src.dim() <= dim or src.shape[dim] != full:
        raise WeightLoadError(
            f"{what}: checkpoint tensor of shape {tuple(src.shape)} needs {full} entries along dim {dim}"
        )
    return src.narrow(dim, rank_index * size, size)


def load_sharded(
    module: Any,
    param: torch.Tensor,
    loaded: torch.Tensor,
    shard_id: Any = None,
    *,
    out_dim: int | None = 0,
    in_dim: int | None = None,
    out_unit: int = 1,
    in_unit: int = 1,
    dtype: torch.dtype | None = None,
) -> None:
    """Copy this rank's part of the full checkpoint tensor `loaded` (shard `shard_id`) into `param`.

    `out_dim` / `in_dim`: which dimension of the tensor runs along the layer's outputs / inputs (None:
    it does not); `out_unit` / `in_unit`: elements per entry along them. `dtype`: the only dtype the
    checkpoint tensor may have (a bf16 weight where fp8 is expected is an error, never a conversion).
    """
    what = f"{getattr(module, 'prefix', '') or type(module).__name__}" + (f" shard {shard_id}" if shard_id is not None else "")
    if dtype is not None and loaded.dtype != dtype:
        raise WeightLoadError(f"{what}: checkpoint tensor has dtype {loaded.dtype}, the quantized layout needs {dtype}")
    s = module.output_shard(shard_id)  # validates the shard id
    dst, src = param.data, loaded
    if out_dim is not None:
        offset, size, full = _units(s, out_unit)
        dst = dst.narrow(out_dim, offset, size)
        src = narrow_rank(src, out_dim, full, s.rank_index, size, what)
    if in_dim is not None:
        i = module.input_shard()
        _, size, full = _units(i, in_unit)
        src = narrow_rank(src, in_dim, full, i.rank_index, size, what)
    check_shape(dst, src, what)
    dst.copy_(src)


def load_per_shard(module: Any, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None, *,
                   in_dim: int | None = None) -> None:
    """One entry per checkpoint shard: row `index` of `param` [num_shards, ...] gets the shard's tensor (a
    static `input_scale` scalar; GPTQ's `g_idx` [in], with `in_dim=0` narrowed to this rank's inputs)."""
    s = module.output_shard(shard_id)
    dst, src = param.data[s.index], loaded
    if in_dim is not None:
        i = module.input_shard()
        src = narrow_rank(src, in_dim, i.full_size, i.rank_index, i.size, module.prefix)
    elif loaded.numel() == 1:
        src = loaded.reshape(dst.shape)
    check_shape(dst, src, module.prefix)
    dst.copy_(src)


def load_row_scale(module: Any, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """A per-output-row scale [rows] from a per-tensor scalar or a per-channel [rows] / [rows, 1] tensor."""
    s = module.output_shard(shard_id)
    if loaded.numel() == 1:
        loaded = loaded.reshape(1).expand(s.full_size)
    elif loaded.dim() == 2 and loaded.shape[1] == 1:
        loaded = loaded[:, 0]
    load_sharded(module, param, loaded, shard_id, out_dim=0)


def add_param(module: torch.nn.Module, name: str, tensor: torch.Tensor, loader: Any, **kwargs: Any) -> torch.nn.Parameter:
    """Register `tensor` as parameter `name` of `module` whose weight_loader is `loader(module, ...)`."""
    param = torch.nn.Parameter(tensor, requires_grad=False)
    module.register_parameter(name, param)
    set_weight_attrs(param, weight_loader=functools.partial(loader, module, **kwargs))
    if module.shard_ids is not None:
        set_weight_attrs(param, shard_ids=module.shard_ids)
    return param
