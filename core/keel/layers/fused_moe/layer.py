"""FusedMoE: the routed experts of a MoE block, stored stacked, computed by a bound kernel or torch.

Built by a model's MoE block; owns `w13_weight` [E, 2 * intermediate, hidden] (gate rows, then up rows,
per expert) and `w2_weight` [E, hidden, intermediate]. Checkpoints ship one tensor per expert and
projection (`mlp.experts.{e}.gate_proj.weight`, ...); `make_expert_params_mapping` turns those names
into (stacked parameter, shard id = (expert id, "w1" | "w2" | "w3")) routes for `load_mapped_weights`,
and the parameters' `weight_loader` copies each into its slot. A stacked parameter counts as loaded
only when every expert's shards arrived.

Routing and expert computation are custom ops (`select_experts`, `fused_experts`; contracts in
`keel.layers.custom_op`): the worker binds a kernel plugin's providers after loading, and an op left
unbound runs the torch reference here (`select_experts`, `fused_experts_torch`). Which path runs is fixed
at bind time, never decided per call.

Fused shared experts (`routing.num_fused_shared_experts` S > 0; SGLang's "shared experts fusion"): the
MoE block's always-on shared MLP is stored as S more experts after the routed ones (a shared MLP of
intermediate S * I is S experts of I: SwiGLU acts per intermediate index and the down projection sums
over them), routing appends them to every token with weight 1.0, and the grouped GEMM reads their
weights beside the routed experts' -- no separate shared-MLP kernels. That pays where the separate MLP is
launch-bound: steps of at most `FUSED_SHARED_MAX_TOKENS` tokens. Larger steps route top_k only and run the
shared experts as dense GEMMs over the same stored weights (one gate_up GEMM, the gated activation, one
down GEMM per shared expert), their sum entering the combine as the residual. Their checkpoint tensors
(`mlp.shared_experts.{gate,up,down}_proj`, `make_shared_expert_params_mapping`) are split by this layer's
`weight_loader`. Unquantized experts without expert parallelism only (the model decides at build).

Quantized experts: with a `quant_config` whose `get_moe_method` returns a `FusedMoEMethod`
(`keel.quantization`), that method registers the expert parameters (`w13_weight` plus its scales, or
int4 `w13_qweight`, ...) and computes the experts after routing, through the bound `fused_experts` op
(given a `FusedMoEQuantConfig`, `quant_config.py`) or its own torch reference. The experts stay
quantized in memory on either path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from keel.layers import side_stream
from keel.layers.activation import get_act_and_mul_fn
from keel.layers.fused_moe.parallel import FusedMoEParallelConfig
from keel.layers.fused_moe.router import RoutingConfig, select_experts
from keel.layers.fused_moe.torch_ref import fused_experts_torch
from keel.models.weights import WeightLoadError, check_shape, set_weight_attrs, shard_size
from keel.quantization import MoELayerSpec, moe_quant_method

# Fused shared experts ride in the grouped GEMM up to this many tokens per step (decode graphs of small
# batches); past it the grouped GEMM would compute their many rows at its lower prefill efficiency than
# dense GEMMs, so they run dense. A function of the token count only: a CUDA graph replays its path.
FUSED_SHARED_MAX_TOKENS = 32


class FusedMoE(nn.Module):
    """Routed experts. `forward(hidden, router_logits)` is called by the MoE block every step.

    `custom_ops` / `bound_ops`: the worker may bind fused kernels for these ops (see
    `keel.layers.custom_op`; a provider may decline a layer, e.g. a routing it does not implement).
    """

    custom_ops: ClassVar[tuple[str, ...]] = ("select_experts", "fused_experts")
    bound_ops: Mapping[str, Callable[..., Any]] = MappingProxyType({})

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        routing: RoutingConfig,
        *,
        activation: str = "silu",
        prefix: str = "",
        parallel: FusedMoEParallelConfig | None = None,
        quant_config: Any = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel = parallel or FusedMoEParallelConfig()
        what = f"{prefix or 'FusedMoE'}:"
        self.local_num_experts = shard_size(num_experts, parallel.ep_size, f"{what} number of experts")
        self.expert_start = parallel.ep_rank * self.local_num_experts
        # This rank's slice of every expert's intermediate dimension (all of it without TP).
        self.intermediate_size_per_partition = shard_size(intermediate_size, parallel.tp_size,
                                                          f"{what} moe_intermediate_size")
        if routing.num_experts != num_experts:
            raise ValueError(f"routing is for {routing.num_experts} experts, layer has {num_experts}")
        self.num_fused_shared_experts = shared = routing.num_fused_shared_experts
        if shared and (parallel.use_ep or quant_config is not None):
            raise ValueError(f"{what} fused shared experts need unquantized experts without expert parallelism "
                             f"(build the shared MLP separately)")
        if shared:  # steps past FUSED_SHARED_MAX_TOKENS: routed-only routing, dense shared experts
            self.routed_only = dataclasses.replace(routing, num_fused_shared_experts=0)
            self.shared_act = get_act_and_mul_fn(activation)  # a child: the worker may bind its kernel
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.routing = routing
        self.activation = activation
        self.prefix = prefix
        e_local, i_part = self.local_num_experts, self.intermediate_size_per_partition
        spec = MoELayerSpec(prefix, num_experts, e_local, hidden_size, i_part, torch.get_default_dtype())
        self.quant_method = moe_quant_method(quant_config, spec)
        if self.quant_method is not None:
            self.quant_method.create_weights(self, spec)
            return
        # Fused shared experts are stored after the routed ones: local ids e_local .. e_local + shared - 1.
        self.w13_weight = nn.Parameter(torch.empty(e_local + shared, 2 * i_part, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(e_local + shared, hidden_size, i_part))
        local = [*range(self.expert_start, self.expert_start + e_local), *(("shared",) if shared else ())]
        for p, ids in ((self.w13_weight, ("w1", "w3")), (self.w2_weight, ("w2",))):
            set_weight_attrs(
                p,
                weight_loader=self.weight_loader,
                shard_ids=tuple((e, s) for e in local for s in ids),
            )

    @staticmethod
    def make_expert_params_mapping(
        num_experts: int,
        ckpt_gate_proj_name: str = "gate_proj",
        ckpt_down_proj_name: str = "down_proj",
        ckpt_up_proj_name: str = "up_proj",
    ) -> list[tuple[str, str, Any]]:
        """(param fragment, checkpoint fragment, shard id) rows for `load_mapped_weights`.

        List them before any dense `.gate_proj` -> `.gate_up_proj` row: the first matching row wins.
        """
        rows = []
        for e in range(num_experts):
            for ckpt, param, shard in (
                (ckpt_gate_proj_name, "w13_", "w1"),
                (ckpt_up_proj_name, "w13_", "w3"),
                (ckpt_down_proj_name, "w2_", "w2"),
            ):
                rows.append((f".experts.{param}", f".experts.{e}.{ckpt}.", (e, shard)))
        return rows

    @staticmethod
    def make_shared_expert_params_mapping(ckpt_prefix: str = "shared_experts") -> list[tuple[str, str, Any]]:
        """Rows routing a shared MLP's checkpoint tensors (`{ckpt_prefix}.gate_proj` ...) into the stacked
        parameters, shard id ("shared", "w1" | "w3" | "w2"); for layers with fused shared experts. List them
        before any dense `.gate_proj` row."""
        return [(f".experts.{param}", f".{ckpt_prefix}.{ckpt}.", ("shared", shard))
                for ckpt, param, shard in (("gate_proj", "w13_", "w1"), ("up_proj", "w13_", "w3"),
                                           ("down_proj", "w2_", "w2"))]

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Receives one expert's full checkpoint tensor; keeps this rank's part (nothing for another
        EP rank's expert: the tensor counts as consumed, so strict loading still sees every name)."""
        ok = isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in ("w1", "w2", "w3")
        if ok and shard_id[0] == "shared" and self.num_fused_shared_experts:
            ok = (shard_id[1] == "w2") == (param is self.w2_weight)
            if ok:
                return self._load_shared(param, loaded_weight, shard_id[1])
        if not ok or not isinstance(shard_id[0], int) or not 0 <= shard_id[0] < self.num_experts \
                or (shard_id[1] == "w2") != (param is self.w2_weight):
            raise WeightLoadError(
                f"{self.prefix or 'FusedMoE'}: expert weights need a shard id (expert, 'w1'|'w2'|'w3') "
                f"valid for this parameter, got {shard_id!r}"
            )
        expert, shard = shard_id
        local = expert - self.expert_start
        if not 0 <= local < self.local_num_experts:
            return
        self._copy_expert(param, local, loaded_weight, shard, f"expert {expert}")

    def _copy_expert(self, param: torch.Tensor, local: int, loaded_weight: torch.Tensor, shard: str,
                     what: str) -> None:
        """One expert's full tensor (w1 / w3 [intermediate, hidden], w2 [hidden, intermediate]) into local slot
        `local`: this TP rank's slice of the intermediate dimension."""
        i, full, rank = self.intermediate_size_per_partition, self.intermediate_size, self.parallel.tp_rank
        if shard == "w2":  # [hidden, intermediate]: this rank's columns
            check_shape(torch.empty(self.hidden_size, full, device="meta"), loaded_weight, f"{what} w2")
            src, dst = loaded_weight.narrow(1, rank * i, i), param.data[local]
        else:  # [intermediate, hidden]: this rank's rows, into the gate (w1) or up (w3) half
            check_shape(torch.empty(full, self.hidden_size, device="meta"), loaded_weight, f"{what} {shard}")
            src = loaded_weight.narrow(0, rank * i, i)
            dst = param.data[local, :i] if shard == "w1" else param.data[local, i:]
        dst.copy_(src)

    def _load_shared(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard: str) -> None:
        """The shared MLP's full tensor (w1 / w3 [S * I, hidden], w2 [hidden, S * I]): intermediate indices
        [s * I, (s + 1) * I) become fused shared expert s (SwiGLU is per index, down sums over them)."""
        s_count, full = self.num_fused_shared_experts, self.intermediate_size
        dim = 1 if shard == "w2" else 0
        rows = (self.hidden_size, s_count * full) if dim else (s_count * full, self.hidden_size)
        check_shape(torch.empty(rows, device="meta"), loaded_weight, f"shared experts {shard}")
        for s in range(s_count):
            self._copy_expert(param, self.local_num_experts + s, loaded_weight.narrow(dim, s * full, full), shard,
                              f"shared expert {s}")

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        router_logits: torch.Tensor,  # [num_tokens, num_experts]
        e_score_correction_bias: torch.Tensor | None = None,  # [num_experts]
        residual: torch.Tensor | None = None,  # [num_tokens, hidden_size], added to the output
    ) -> torch.Tensor:  # [num_tokens, hidden_size]; weighted sum of the chosen experts' outputs (+ residual)
        """`residual` (e.g. shared experts' output) may be added inside a bound kernel's combine step, saving
        a launch; the result equals `forward(hidden, router_logits, bias) + residual` on either path."""
        dense_shared = bool(self.num_fused_shared_experts) and hidden.shape[0] > FUSED_SHARED_MAX_TOKENS
        side, shared = None, None
        if dense_shared:
            # Inside a graph capture the dense shared experts run on a side stream beside routing and the routed
            # experts and join before the final add (`side_stream`); otherwise they run first and enter the
            # combine as its residual.
            side = side_stream.fork(hidden)
            with side_stream.on(side):
                shared = self._shared_experts_dense(hidden)
            if side is None:
                residual = shared if residual is None else shared + residual
        routing = self.routed_only if dense_shared else self.routing
        route = self.bound_ops.get("select_experts")
        if route is not None:
            topk_weights, topk_ids = route(router_logits, routing, e_score_correction_bias)
        else:
            topk_weights, topk_ids = select_experts(router_logits, routing, e_score_correction_bias)
        if topk_ids.shape[-1] != routing.num_routes:  # shapes only: no host sync
            raise RuntimeError(f"{self.prefix or 'FusedMoE'}: routing returned {topk_ids.shape[-1]} routes per "
                               f"token, expected top_k + fused shared experts = {routing.num_routes}")
        if side is None:
            return self._routed(hidden, topk_weights, topk_ids, residual)
        out = self._routed(hidden, topk_weights, topk_ids, None)
        side_stream.join(side)
        out += shared if residual is None else shared + residual  # rounds as the combine adds its residual
        return out

    def _routed(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        topk_weights: torch.Tensor,  # [num_tokens, num_routes] float32
        topk_ids: torch.Tensor,  # [num_tokens, num_routes]
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        if self.parallel.use_ep:
            topk_weights, topk_ids = self._keep_local_routes(topk_weights, topk_ids)
        experts = self.bound_ops.get("fused_experts")
        if self.quant_method is not None:
            return self.quant_method.apply(self, hidden, topk_weights, topk_ids, residual, experts)
        if experts is not None:
            return experts(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.activation,
                           residual)
        out = fused_experts_torch(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.activation)
        return out if residual is None else out + residual

    def _shared_experts_dense(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        """The fused shared experts as dense GEMMs over their stored slots (steps past
        FUSED_SHARED_MAX_TOKENS): this rank's partial sum, like the routed experts'."""
        e, s, i = self.local_num_experts, self.num_fused_shared_experts, self.intermediate_size_per_partition
        gate_up = F.linear(hidden, self.w13_weight[e:].reshape(s * 2 * i, self.hidden_size))  # [T, S * 2I]
        act = self.shared_act(gate_up.view(-1, 2 * i)).view(hidden.shape[0], s, i)  # [T, S, I]
        out = F.linear(act[:, 0], self.w2_weight[e])
        for k in range(1, s):
            out = torch.addmm(out, act[:, k], self.w2_weight[e + k].t())
        return out

    def _keep_local_routes(
        self,
        topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
        topk_ids: torch.Tensor,  # [num_tokens, top_k] global expert ids
    ) -> tuple[torch.Tensor, torch.Tensor]:  # local ids; routes to other ranks' experts weigh 0
        # Dispatch under EP: a route to another rank's expert points at local expert 0 with weight 0,
        # so it adds exactly nothing here and is computed where that expert lives (static shapes).
        local = topk_ids - self.expert_start
        mine = (local >= 0) & (local < self.local_num_experts)
        return torch.where(mine, topk_weights, 0.0), torch.where(mine, local, 0).to(topk_ids.dtype)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts} ({self.local_num_experts} here) + {self.num_fused_shared_experts} "
            f"fused shared, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, top_k={self.routing.top_k}, bound={sorted(self.bound_ops)}"
        )
