"""LazySafetensor: a checkpoint tensor whose data is read only when, and only as far as, it is used.

`iterate_safetensors` yields these, so a weight loader that narrows a tensor to its rank's shard
(`narrow`, basic slicing) reads only that shard from disk, and a tensor nobody on this rank needs (another
pipeline stage's layer, another EP rank's expert) is never read at all. Anything else -- a torch function
taking it, any other tensor attribute -- reads the (narrowed) tensor and carries on, so loaders written
for plain tensors keep working. Valid while the iteration that yielded it is at that item.
"""

from __future__ import annotations

from typing import Any

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _real(x: Any) -> Any:
    """`x` with every LazySafetensor inside (lists, tuples, dicts too) read."""
    if isinstance(x, LazySafetensor):
        return x.materialize()
    if isinstance(x, list | tuple):
        return type(x)(_real(v) for v in x)
    if isinstance(x, dict):
        return {k: _real(v) for k, v in x.items()}
    return x


def dtype_of(safetensors_dtype: str) -> torch.dtype | None:
    return _DTYPES.get(safetensors_dtype)


class LazySafetensor:
    def __init__(self, source: Any, ranges: tuple[tuple[int, int], ...], dtype: torch.dtype) -> None:
        self._source = source  # a safetensors PySafeSlice
        self._ranges = ranges  # per dimension: [start, stop) of the source still in view
        self.dtype = dtype

    @classmethod
    def of(cls, source: Any, dtype: torch.dtype) -> LazySafetensor:
        return cls(source, tuple((0, n) for n in source.get_shape()), dtype)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(b - a for a, b in self._ranges)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self._ranges)

    def numel(self) -> int:
        return self.shape.numel()

    def narrow(self, dim: int, start: int, length: int) -> LazySafetensor:
        dim = dim % self.dim()
        a, b = self._ranges[dim]
        if start < 0 or length < 0 or a + start + length > b:
            raise IndexError(f"narrow({dim}, {start}, {length}) outside a tensor of shape {tuple(self.shape)}")
        ranges = list(self._ranges)
        ranges[dim] = (a + start, a + start + length)
        return LazySafetensor(self._source, tuple(ranges), self.dtype)

    def __getitem__(self, key: Any) -> Any:
        keys = key if isinstance(key, tuple) else (key,)
        if not all(isinstance(k, slice) and k.step in (None, 1) for k in keys) or len(keys) > self.dim():
            return self.materialize()[key]
        out = self
        for dim, k in enumerate(keys):
            start, stop, _ = k.indices(out.shape[dim])
            out = out.narrow(dim, start, max(0, stop - start))
        return out

    def materialize(self) -> torch.Tensor:
        """Read the viewed part from the file."""
        return self._source[tuple(slice(a, b) for a, b in self._ranges)]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return func(*_real(tuple(args)), **_real(dict(kwargs or {})))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    def __repr__(self) -> str:
        return f"LazySafetensor(shape={tuple(self.shape)}, dtype={self.dtype})"


def _operator(name: str) -> Any:
    def op(self: LazySafetensor, *args: Any) -> Any:
        return getattr(self.materialize(), name)(*_real(args))

    op.__name__ = name
    return op


# Python looks operators up on the type, past __getattr__: each reads the tensor and applies the real one.
for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
              "__matmul__", "__rmatmul__", "__pow__", "__neg__", "__abs__", "__eq__", "__ne__", "__lt__", "__le__",
              "__gt__", "__ge__", "__len__", "__iter__", "__float__", "__int__", "__bool__", "__array__"):
    setattr(LazySafetensor, _name, _operator(_name))

