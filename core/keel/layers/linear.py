"""Linear layers with tensor-parallel sharding and their weight loaders (names mirror vLLM's).

Each layer holds only this rank's shard; the parameters' `weight_loader` receives the *full* checkpoint
tensor and narrows it, so checkpoints never need resharding offline. Column-parallel layers split the
output dimension (dim 0 of the weight), row-parallel layers split the input dimension (dim 1). The
split logic is unit-tested with `tp_size=2`; multi-process fidelity runs in tests/test_distributed_tp.py.

Quantization: given the build's `quant_config` (a `keel.quantization.QuantizationConfig`, or a single
`QuantizationMethod` applied to every layer), a layer asks it for a method with its `LinearLayerSpec`;
that method then creates the weights (each with its own `weight_loader`) and computes the forward.
`None` keeps the plain dense weight.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from keel.distributed.communication_op import tensor_model_parallel_all_reduce
from keel.models.weights import WeightLoadError, check_shape, set_weight_attrs, shard_size
from keel.quantization import LinearLayerSpec, QuantizationMethod


def _copy_rank_rows(dst: torch.Tensor, loaded_weight: torch.Tensor, full_rows: int, rank_index: int,
                    what: str = "") -> None:
    """Copy slice `rank_index` (of `dst.shape[0]` rows) of a full checkpoint tensor into `dst`.

    The checkpoint must hold `full_rows` rows, so a wrong tensor is reported at its full shape rather
    than as a confusing slice mismatch.
    """
    size = dst.shape[0]
    if loaded_weight.shape[0] != full_rows:
        check_shape(torch.empty(full_rows, *dst.shape[1:], device="meta"), loaded_weight, what)
    src = loaded_weight.narrow(0, rank_index * size, size)
    check_shape(dst, src, what)
    dst.copy_(src)


@dataclass(frozen=True)
class ShardSlice:
    """Where one checkpoint tensor's slice lives along one dimension (rows for outputs, columns for inputs).

    This rank holds `size` elements at `offset` of its own (stacked) parameter; they are slice number
    `rank_index` (of `size` elements each) of the checkpoint tensor's `full_size`. `index` is the shard's
    position in stacking order. Quantization methods scale these by their block or packing factors.
    """

    offset: int
    size: int
    full_size: int
    rank_index: int
    index: int = 0


def _quant_method(quant_config: Any, spec: LinearLayerSpec) -> QuantizationMethod | None:
    if quant_config is None:
        return None
    if hasattr(quant_config, "get_quant_method"):
        return quant_config.get_quant_method(spec)
    return quant_config  # already a per-layer method


class LinearBase(nn.Module):
    """Holds `weight` [out_per_rank, in_per_rank] and optional `bias` [out_per_rank].

    With a quantization method, `weight` is whatever the method registers and `forward` calls its
    `apply`; the bias stays a plain parameter. `prefix` is the parameter path quantization configs
    match layers by (e.g. "model.layers.0.self_attn.qkv_proj").

    `custom_ops` / `bound_ops`: without a quantization method the worker may bind a plugin's
    `linear_small_m` kernel (see `keel.layers.custom_op`), which takes decode-sized steps where it was
    measured faster than F.linear; unbound, F.linear.
    """

    custom_ops: ClassVar[tuple[str, ...]] = ("linear_small_m",)
    bound_ops: Mapping[str, Callable[..., Any]] = MappingProxyType({})
    input_source: tuple[LinearBase, int] | None = None  # set_input_source
    input_producer: tuple[nn.Module] | None = None  # set_input_producer (a tuple: not registered as a child)

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp_size: int = 1,
        tp_rank: int = 0,
        *,
        quant_config: Any = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
        self.input_size = input_size
        self.output_size = output_size
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.prefix = prefix
        spec = LinearLayerSpec(
            prefix=prefix,
            input_size=self.input_size_per_partition,
            output_partition_sizes=self.output_partition_sizes,
            params_dtype=torch.get_default_dtype(),
            bias=bias,
        )
        self.quant_method = _quant_method(quant_config, spec)
        if self.quant_method is None:
            self.weight = nn.Parameter(
                torch.empty(self.output_size_per_partition, self.input_size_per_partition)
            )
            set_weight_attrs(self.weight, weight_loader=self.weight_loader)
        else:
            self.quant_method.create_weights(self, spec)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_partition))
            set_weight_attrs(self.bias, weight_loader=self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def set_input_source(self, producer: LinearBase, parts: int = 2) -> None:
        """Declared by a model once it has built both: this layer's input is an elementwise function of
        `producer`'s outputs cut into `parts` equal blocks (gate_up -> act_and_mul -> down: 2), so a permutation
        of this layer's inputs may be applied to `producer`'s outputs instead, one block at a time."""
        self.input_source = (producer, parts)

    def set_input_producer(self, producer: nn.Module) -> None:
        """Declared by a model once it has built both: `producer`'s output (a norm's, a gated activation's) is this
        layer's input, unchanged and read by nothing but the layers that declare it, so it may arrive quantized as
        their methods want it (`keel.layers.input_quant`)."""
        self.input_producer = (producer,)

    def _own_params(self) -> list[nn.Parameter]:
        """Parameters loaded by this layer's own `weight_loader` (not by a quantization method's)."""
        return [
            p
            for p in self.parameters(recurse=False)
            if getattr(p, "weight_loader", None) == self.weight_loader
        ]

    @property
    def output_partition_sizes(self) -> tuple[int, ...]:
        """This rank's output slices, in stacking order (what a quantization method sees)."""
        return (self.output_size_per_partition,)

    @property
    def shard_ids(self) -> tuple[Any, ...] | None:
        """The checkpoint shard ids of a stacked layer, in stacking order; None when not stacked."""
        return None

    @property
    def output_size_per_partition(self) -> int:
        return self.output_size

    @property
    def input_size_per_partition(self) -> int:
        return self.input_size

    def output_shard(self, shard_id: Any = None) -> ShardSlice:
        """Where checkpoint shard `shard_id` (None: not stacked) goes along the output dimension."""
        if shard_id is not None:
            raise WeightLoadError(f"{type(self).__name__} is not stacked; got shard id {shard_id!r}")
        return ShardSlice(0, self.output_size_per_partition, self.output_size, 0)

    def input_shard(self) -> ShardSlice:
        """This rank's slice of the input dimension."""
        return ShardSlice(0, self.input_size_per_partition, self.input_size, 0)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        self.output_shard(shard_id)  # validates the shard id
        check_shape(param, loaded_weight)
        param.data.copy_(loaded_weight)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x may be a QuantizedInput from a producer bound to this layer's method (keel.layers.input_quant)
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        op = self.bound_ops.get("linear_small_m")  # a plugin's kernel for decode-sized steps, where measured
        if op is not None:
            return op(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, input_size_per_partition]
        return self._matmul(x, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, tp={self.tp_size}"
        )


def fold_input_permutations(model: nn.Module) -> int:
    """Called by the loader once every layer's method has processed its weights: for each layer with a declared
    input source whose method permutes its inputs (`keel.quantization.PermutedInputMethod`) and whose producer's
    method can reorder its outputs, the permutation moves to the producer's outputs (each of its `parts` blocks
    by the same permutation, so an elementwise pairing like silu(gate) * up stays paired): the same numbers, one
    activation gather fewer per forward. Returns how many layers were folded."""
    from keel.quantization import PermutedInputMethod

    folded = 0
    for consumer in model.modules():
        if not isinstance(consumer, LinearBase) or consumer.input_source is None:
            continue
        producer, parts = consumer.input_source
        take, give = consumer.quant_method, producer.quant_method
        if not (isinstance(take, PermutedInputMethod) and isinstance(give, PermutedInputMethod)):
            continue
        k = consumer.input_size_per_partition
        if producer.output_size_per_partition != parts * k:
            raise ValueError(f"{consumer.prefix} declares its input from {producer.prefix} in {parts} blocks, but "
                             f"{producer.output_size_per_partition} outputs are not {parts} x {k} inputs")
        perm = take.take_input_permutation(consumer)
        if perm is None:
            continue
        index = torch.cat([perm.long() + p * k for p in range(parts)])  # [parts * k]
        give.permute_outputs(producer, index)
        if producer.bias is not None:
            producer.bias.data = producer.bias.data.index_select(0, index.to(producer.bias.device))
        folded += 1
    return folded


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""


class ColumnParallelLinear(LinearBase):
    """Output dimension split across ranks; each rank's output is its slice (no communication)."""

    @property
    def output_size_per_partition(self) -> int:
        return shard_size(self.output_size, self.tp_size, f"{type(self).__name__} output size")

    def output_shard(self, shard_id: Any = None) -> ShardSlice:
        if shard_id is not None:
            raise WeightLoadError(f"{type(self).__name__} is not stacked; got shard id {shard_id!r}")
        return ShardSlice(0, self.output_size_per_partition, self.output_size, self.tp_rank)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        s = self.output_shard(shard_id)
        what = "" if shard_id is None else f"shard {shard_id}"
        _copy_rank_rows(param.data.narrow(0, s.offset, s.size), loaded_weight, s.full_size, s.rank_index, what)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked in one weight (gate_up_proj: shard ids 0 and 1).

    Each logical output is split across ranks separately, so rank r holds [gate_r; up_r].
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        tp_size: int = 1,
        tp_rank: int = 0,
        *,
        quant_config: Any = None,
        prefix: str = "",
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(
            input_size,
            sum(self.output_sizes),
            bias,
            tp_size,
            tp_rank,
            quant_config=quant_config,
            prefix=prefix,
        )
        for p in self._own_params():
            set_weight_attrs(p, shard_ids=self.shard_ids)

    @property
    def output_partition_sizes(self) -> tuple[int, ...]:
        return tuple(shard_size(s, self.tp_size, f"output {i}") for i, s in enumerate(self.output_sizes))

    @property
    def shard_ids(self) -> tuple[Any, ...] | None:
        return tuple(range(len(self.output_sizes)))

    def shard_offset_size(self, shard_id: int) -> tuple[int, int]:
        """(offset, size) of logical output `shard_id` inside this rank's stacked output."""
        s = self.output_shard(shard_id)
        return s.offset, s.size

    def output_shard(self, shard_id: Any = None) -> ShardSlice:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise WeightLoadError(
                f"{type(self).__name__} needs shard id in 0..{len(self.output_sizes) - 1}, got {shard_id!r}"
            )
        sizes = self.output_partition_sizes
        return ShardSlice(sum(sizes[:shard_id]), sizes[shard_id], self.output_sizes[shard_id], self.tp_rank,
                          shard_id)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections stacked in one weight (shard ids "q", "k", "v").

    Query heads are split across ranks. KV heads are split when there are at least `tp_size` of them,
    otherwise replicated so each rank holds one (rank r uses kv head r // replicas), as in vLLM.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        tp_size: int = 1,
        tp_rank: int = 0,
        *,
        quant_config: Any = None,
        prefix: str = "",
    ) -> None:
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = shard_size(total_num_heads, tp_size, "number of attention heads")
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = shard_size(total_num_kv_heads, tp_size, "number of KV heads")
            self.num_kv_head_replicas = 1
        else:
            if tp_size % total_num_kv_heads != 0:
                raise ValueError(
                    f"tensor parallel size {tp_size} is not a multiple of the number of KV heads "
                    f"{total_num_kv_heads}"
                )
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp_size // total_num_kv_heads
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        output_size = (total_num_heads + 2 * self.num_kv_heads * tp_size) * head_size
        super().__init__(
            hidden_size, output_size, bias, tp_size, tp_rank, quant_config=quant_config, prefix=prefix
        )
        for p in self._own_params():
            set_weight_attrs(p, shard_ids=self.shard_ids)

    @property
    def output_partition_sizes(self) -> tuple[int, ...]:
        return (self.q_size, self.kv_size, self.kv_size)

    @property
    def shard_ids(self) -> tuple[Any, ...] | None:
        return ("q", "k", "v")

    @property
    def output_size_per_partition(self) -> int:
        return self.q_size + 2 * self.kv_size

    def output_shard(self, shard_id: Any = None) -> ShardSlice:
        if shard_id == "q":
            return ShardSlice(0, self.q_size, self.total_num_heads * self.head_size, self.tp_rank, 0)
        if shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            return ShardSlice(offset, self.kv_size, self.total_num_kv_heads * self.head_size,
                              self.tp_rank // self.num_kv_head_replicas, 1 if shard_id == "k" else 2)
        raise WeightLoadError(f"QKVParallelLinear needs shard id 'q', 'k' or 'v', got {shard_id!r}")

    def split_qkv(
        self,
        qkv: torch.Tensor,  # [num_tokens, q_size + 2 * kv_size]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks; partial outputs are summed (all-reduce) when `reduce_results`.

    The bias is added on rank 0 only, so the reduction counts it once.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_size: int = 1,
        tp_rank: int = 0,
        reduce_results: bool = True,
        *,
        quant_config: Any = None,
        prefix: str = "",
    ) -> None:
        self.reduce_results = reduce_results
        super().__init__(
            input_size, output_size, bias, tp_size, tp_rank, quant_config=quant_config, prefix=prefix
        )

    @property
    def input_size_per_partition(self) -> int:
        return shard_size(self.input_size, self.tp_size, f"{type(self).__name__} input size")

    def input_shard(self) -> ShardSlice:
        return ShardSlice(0, self.input_size_per_partition, self.input_size, self.tp_rank)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        self.output_shard(shard_id)  # validates the shard id
        if param.dim() == 2:  # the bias is not split
            n = param.shape[1]
            if loaded_weight.dim() != 2 or loaded_weight.shape[1] != n * self.tp_size:
                check_shape(torch.empty(param.shape[0], n * self.tp_size, device="meta"), loaded_weight)
            loaded_weight = loaded_weight.narrow(1, self.tp_rank * n, n)
        check_shape(param, loaded_weight)
        param.data.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, input_size_per_partition]
        out = self._matmul(x, self.bias if self.tp_rank == 0 else None)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out, self.tp_size)
        return out
