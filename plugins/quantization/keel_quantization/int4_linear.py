"""Weight-only 4-bit linear layers (GPTQ and AWQ checkpoints), one runtime form for both.

Loading keeps the checkpoint's tensors (see `int4_math` for the layouts); after loading both become
`qweight` int32 [in / 8, out] packed along the input (GPTQ's order), `zeros` and `scales` [groups, out]
in the model dtype (zeros already decoded) and `g_idx` int32 [in]. Forward: on a CUDA device the Triton
kernel dequantizes tiles inside the GEMM (`int4_triton`); elsewhere the reference path dequantizes the
weight and multiplies (CPU, or `backend="torch"`); steps of `DEQUANT_GEMM_MIN_M` tokens or more on CUDA
(prefill chunks, full-batch decode) dequantize the weight with a Triton kernel and run one cuBLAS GEMM -- unless
this device has measured the mid-size int4 GEMM (`int4_mma_triton`) faster for the step's size
(`int4_mma_plans`). Where inputs are in group order the kernel reads one scale row per K tile
(`group_in_order`, decided once after loading).

GPTQ's act-order checkpoints (desc_act: `g_idx` assigns inputs to groups out of order) are put in group order
once after loading, as Marlin does: the inputs are permuted so their groups run in order (`input_perm`, the
stable sort of g_idx; qweight's rows follow it), and each forward gathers the activations' columns by it first
-- one small gather a layer instead of the gathered-group kernels (a scale and zero per input, "correct, not
fast") at every size -- unless the loader moved the permutation into the layer producing the input
(`take_input_permutation`: down_proj's into gate_up's outputs). The products are the same, summed in another
order.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from keel.quantization import LinearLayerSpec, QuantizationError
from keel_quantization import int4_dummy, int4_math
from keel_quantization.int4_mma_plans import MmaTile, misfit, mma_tile
from keel_quantization.loading import add_param, load_per_shard, load_sharded

BACKENDS = ("auto", "torch", "triton")
# Steps of at least this many tokens dequantize the weight in full and run one cuBLAS GEMM
# (`int4_dequant_triton`): cuBLAS's bf16 rate beats the in-register dequantizing GEMM there. H200 at 3158d24
# (h200-int4-prefill-3158d24.json, Llama-8B's four layers, us): M=128 in-GEMM 529 / dequantize + cuBLAS 480
# (gate_up still loses), M=256 769 / 477 (every layer wins: the crossover), M=8192 18,774 / 4,838 (bf16
# cuBLAS on a ready weight 4,950). The dequantize alone: 169.5 us for the four back to back at 2328ea6, 1.31x
# its int4-read + bf16-written floor (h200-int4-dequant-2328ea6.json); the rest of the gap to bf16 is its GEMM's.
DEQUANT_GEMM_MIN_M = 256


@functools.cache
def _device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


@dataclass(frozen=True)
class Int4Format:
    method: str  # "gptq" | "awq"
    group_size: int  # inputs per scale group; -1: one group over all inputs
    zero_offset: int = 0  # added to stored zeros (GPTQ v1 checkpoints store zero - 1)
    desc_act: bool = False  # GPTQ: inputs grouped by `g_idx` in activation order


def _ints(module: torch.nn.Module, name: str, shape: tuple[int, ...], **kw) -> None:
    add_param(module, name, torch.zeros(shape, dtype=torch.int32), load_sharded, dtype=torch.int32, **kw)


def tileable_group(g_idx: torch.Tensor, group: int) -> int:
    """`group` if input k is in group k // group (AWQ; GPTQ without desc_act) and the GEMM can tile by it (a
    power of two from 8, or every input one group), else 0. Once, after loading (it reads g_idx back)."""
    k = g_idx.shape[0]
    group = min(group, k)
    if group < k and (group < 8 or group & (group - 1)):
        return 0
    in_order = torch.arange(k, device=g_idx.device, dtype=torch.int32) // group
    return group if bool((g_idx.to(torch.int32) == in_order).all()) else 0


class Int4LinearMethod:
    """Created per layer by the GPTQ / AWQ configs' `get_quant_method`."""

    def __init__(self, fmt: Int4Format, backend: str = "auto") -> None:
        if backend not in BACKENDS:
            raise QuantizationError(f"int4 backend must be one of {BACKENDS}, got {backend!r}")
        self.fmt = fmt
        self.backend = backend
        self.params_dtype = torch.float32
        self.last_backend: str | None = None  # which path the latest forward took (tests)
        self.group_in_order = 0  # > 0: g_idx is k // this (the GEMM reads one scale row per K tile); 0: gather

    def _group(self, k: int) -> int:
        return k if self.fmt.group_size == -1 else self.fmt.group_size

    def _check(self, module: torch.nn.Module, layer: LinearLayerSpec) -> None:
        f, k = self.fmt, layer.input_size
        bad = [s for s in layer.output_partition_sizes if s % int4_math.PACK]
        if bad:
            raise QuantizationError(f"{f.method}: layer {layer.prefix} has output slices {layer.output_partition_sizes}, "
                                    f"not all multiples of {int4_math.PACK} (packed 4-bit columns)")
        split_in = module.input_size_per_partition != module.input_size
        if k % int4_math.PACK or (split_in and k % self._group(module.input_size)):
            raise QuantizationError(f"{f.method}: layer {layer.prefix} has {k} inputs per rank, not a multiple of "
                                    f"{int4_math.PACK} and of the group size {f.group_size}")
        if split_in and f.desc_act:
            raise QuantizationError(f"{f.method}: desc_act checkpoints cannot split a layer's inputs across "
                                    f"tensor-parallel ranks yet ({layer.prefix})")

    def create_weights(self, module: torch.nn.Module, layer: LinearLayerSpec) -> None:
        self._check(module, layer)
        self.params_dtype = layer.params_dtype
        k, n = layer.input_size, sum(layer.output_partition_sizes)
        group = self._group(module.input_size)
        groups = math.ceil(k / group)
        pack = int4_math.PACK
        if self.fmt.method == "gptq":
            _ints(module, "qweight", (k // pack, n), out_dim=1, in_dim=0, in_unit=pack)
            add_param(module, "g_idx", torch.zeros(len(layer.output_partition_sizes), k, dtype=torch.int32),
                      load_per_shard, in_dim=0)
        else:
            _ints(module, "qweight", (k, n // pack), out_dim=1, out_unit=pack, in_dim=0)
        _ints(module, "qzeros", (groups, n // pack), out_dim=1, out_unit=pack, in_dim=0, in_unit=group)
        add_param(module, "scales", torch.zeros(groups, n, dtype=torch.float16), load_sharded, out_dim=1, in_dim=0,
                  in_unit=group)
        first = module.input_shard().rank_index * k  # this rank's first checkpoint input
        int4_dummy.mark(module, qweight=int4_dummy.random_words, qzeros=int4_dummy.random_words,
                        scales=int4_dummy.scales(module.input_size),
                        **({"g_idx": int4_dummy.group_ids(group, first)} if self.fmt.method == "gptq" else {}))

    def process_weights_after_loading(self, module: torch.nn.Module) -> None:
        f = self.fmt
        k = module.qweight.shape[0] * (int4_math.PACK if f.method == "gptq" else 1)
        if f.method == "gptq":
            g_idx = module.g_idx.data
            if not bool((g_idx == g_idx[:1]).all()):
                raise QuantizationError(f"gptq: the shards of fused layer {module.prefix} have different g_idx "
                                        "(input orders); keel needs them equal")
            g_idx = g_idx[0]
            zeros = int4_math.unpack_cols(module.qzeros.data) + f.zero_offset
            qweight = module.qweight.data
        else:
            g_idx = torch.arange(k, dtype=torch.int32, device=module.qweight.device) // self._group(k)
            zeros = int4_math.unpack_cols(module.qzeros.data, int4_math.AWQ_ORDER)
            qweight = int4_math.pack_rows(int4_math.unpack_cols(module.qweight.data, int4_math.AWQ_ORDER))
        groups = module.scales.shape[0]
        if f.method == "gptq" and module.input_size_per_partition != module.input_size:
            g_idx = g_idx - module.input_shard().rank_index * groups  # checkpoint groups -> this rank's
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise QuantizationError(f"{f.method}: {module.prefix}.g_idx names groups outside 0..{groups - 1}")
        del module.qzeros
        if hasattr(module, "g_idx"):
            del module.g_idx
        self.group_in_order = tileable_group(g_idx, self._group(k))
        frozen = lambda t: torch.nn.Parameter(t.contiguous(), requires_grad=False)
        module.input_perm = None
        if not self.group_in_order:  # act order: permute the inputs into group order where that gives whole groups
            perm = torch.argsort(g_idx, stable=True)
            self.group_in_order = tileable_group(g_idx[perm], self._group(k))
            if self.group_in_order:
                qweight = int4_math.pack_rows(int4_math.unpack_rows(qweight)[perm])
                g_idx = g_idx[perm]
                module.input_perm = frozen(perm)  # [in] int64: activation column j of the kernels is input perm[j]
        module.qweight = frozen(qweight)
        module.g_idx = frozen(g_idx.to(torch.int32))
        module.zeros = frozen(zeros.to(self.params_dtype))
        module.scales = frozen(module.scales.data.to(self.params_dtype))

    def take_input_permutation(self, module: torch.nn.Module) -> torch.Tensor | None:
        """`keel.quantization.PermutedInputMethod`: act order's permutation (None in order), given up -- the loader
        has the layer producing this input emit it permuted (down_proj's into gate_up's outputs)."""
        perm = getattr(module, "input_perm", None)
        module.input_perm = None
        return perm

    def permute_outputs(self, module: torch.nn.Module, index: torch.Tensor) -> None:
        """`keel.quantization.PermutedInputMethod`: output j becomes output index[j] (qweight's, the scales' and the
        zeros' columns; after `process_weights_after_loading`, in every format)."""
        for name in ("qweight", "scales", "zeros"):
            param = getattr(module, name)
            param.data = param.data.index_select(1, index.to(param.device)).contiguous()

    def mma_tile(self, m: int, n: int, k: int, dtype: torch.dtype, device_name: str) -> MmaTile | None:
        """The mid-size int4 GEMM's tile for a step of m tokens on a layer of n outputs x k inputs, where measured
        on this device (`int4_mma_plans`) and the layer's groups fit it; None: the tile GEMM or dequantize +
        cuBLAS."""
        if self.group_in_order <= 0 or dtype not in (torch.bfloat16, torch.float16):
            return None
        tile = mma_tile(m, n, k, device_name, str(dtype).removeprefix("torch."))
        return None if tile is None or misfit(k, self.group_in_order, tile) else tile

    def _dequantized(self, module: torch.nn.Module) -> torch.Tensor:  # [out, in] in the kernels' input order
        q = int4_math.unpack_rows(module.qweight)
        return int4_math.dequantize_int4(q, module.zeros, module.scales, module.g_idx, self.params_dtype).T

    def dequantize_weight(self, module: torch.nn.Module) -> torch.Tensor:  # [out, in] in the model dtype
        """The layer's weight in the order of the inputs it receives (layers that read it, tests): the checkpoint's,
        unless the loader moved its permutation into the producer of its input, and in the order of the outputs it
        gives (permuted where it is that producer)."""
        w = self._dequantized(module)
        if getattr(module, "input_perm", None) is None:
            return w
        out = torch.empty_like(w)
        out[:, module.input_perm] = w  # kernel column j is input perm[j]
        return out

    def apply(
        self,
        module: torch.nn.Module,
        x: torch.Tensor,  # [num_tokens, input_size]
        bias: torch.Tensor | None = None,  # [output_size]
    ) -> torch.Tensor:  # [num_tokens, output_size]
        x2 = x.reshape(-1, x.shape[-1])
        use_triton = self.backend == "triton" or (self.backend == "auto" and x.is_cuda)
        if getattr(module, "input_perm", None) is not None:  # act order, put in group order after loading
            if use_triton and x2.stride(1) == 1:  # a PDL launch like the GEMMs around it (gather_columns says why)
                from keel_quantization.gather_columns import gather_columns

                x2 = gather_columns(x2, module.input_perm)
            else:
                x2 = x2.index_select(1, module.input_perm)
        tile = (self.mma_tile(x2.shape[0], module.qweight.shape[1], x2.shape[1], x2.dtype,
                              _device_name(x2.device.index))
                if use_triton and x2.is_cuda else None)
        if tile is not None:
            from keel_quantization.int4_mma_triton import int4_mma_gemm

            self.last_backend = "triton_mma"
            out = int4_mma_gemm(x2, module.qweight, module.scales, module.zeros, self.group_in_order, tile=tile)
            if bias is not None:
                out = out + bias
        elif use_triton and x2.shape[0] >= DEQUANT_GEMM_MIN_M:
            from keel_quantization.int4_dequant_triton import int4_dequantize

            self.last_backend = "triton_dequant"
            w = int4_dequantize(module.qweight, module.scales, module.zeros, module.g_idx, x.dtype,
                                self.group_in_order)  # [in, out]
            out = x2 @ w if bias is None else torch.addmm(bias, x2, w)
        elif use_triton:
            from keel_quantization.int4_triton import int4_gemm

            self.last_backend = "triton"
            out = int4_gemm(x2, module.qweight, module.scales, module.zeros, module.g_idx,
                            group_size=self.group_in_order)
            if bias is not None:
                out = out + bias
        else:
            self.last_backend = "torch"
            out = torch.nn.functional.linear(x2, self._dequantized(module).to(x.dtype), bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])
