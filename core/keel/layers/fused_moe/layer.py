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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import nn

from keel.layers.fused_moe.router import RoutingConfig, select_experts
from keel.layers.fused_moe.torch_ref import fused_experts_torch
from keel.models.weights import WeightLoadError, check_shape, set_weight_attrs


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
    ) -> None:
        super().__init__()
        if routing.num_experts != num_experts:
            raise ValueError(f"routing is for {routing.num_experts} experts, layer has {num_experts}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.routing = routing
        self.activation = activation
        self.prefix = prefix
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        for p, ids in ((self.w13_weight, ("w1", "w3")), (self.w2_weight, ("w2",))):
            set_weight_attrs(
                p,
                weight_loader=self.weight_loader,
                shard_ids=tuple((e, s) for e in range(num_experts) for s in ids),
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

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id in param.shard_ids):
            raise WeightLoadError(
                f"{self.prefix or 'FusedMoE'}: expert weights need a shard id (expert, 'w1'|'w2'|'w3') "
                f"valid for this parameter, got {shard_id!r}"
            )
        expert, shard = shard_id
        i = self.intermediate_size
        if shard == "w1":
            dst = param.data[expert, :i]
        elif shard == "w3":
            dst = param.data[expert, i:]
        else:
            dst = param.data[expert]
        check_shape(dst, loaded_weight, f"expert {expert} {shard}")
        dst.copy_(loaded_weight)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        router_logits: torch.Tensor,  # [num_tokens, num_experts]
        e_score_correction_bias: torch.Tensor | None = None,  # [num_experts]
        residual: torch.Tensor | None = None,  # [num_tokens, hidden_size], added to the output
    ) -> torch.Tensor:  # [num_tokens, hidden_size]; weighted sum of the chosen experts' outputs (+ residual)
        """`residual` (e.g. shared experts' output) may be added inside a bound kernel's combine step, saving
        a launch; the result equals `forward(hidden, router_logits, bias) + residual` on either path."""
        route = self.bound_ops.get("select_experts")
        if route is not None:
            topk_weights, topk_ids = route(router_logits, self.routing, e_score_correction_bias)
        else:
            topk_weights, topk_ids = select_experts(router_logits, self.routing, e_score_correction_bias)
        experts = self.bound_ops.get("fused_experts")
        if experts is not None:
            return experts(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.activation,
                           residual)
        out = fused_experts_torch(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.activation)
        return out if residual is None else out + residual

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
            f"top_k={self.routing.top_k}, bound={sorted(self.bound_ops)}"
        )
