"""FusedMoE: the routed experts of a MoE block, stored stacked, computed by Triton or torch.

Built by a model's MoE block; owns `w13_weight` [E, 2 * intermediate, hidden] (gate rows, then up rows,
per expert) and `w2_weight` [E, hidden, intermediate]. Checkpoints ship one tensor per expert and
projection (`mlp.experts.{e}.gate_proj.weight`, ...); `make_expert_params_mapping` turns those names
into (stacked parameter, shard id = (expert id, "w1" | "w2" | "w3")) routes for `load_mapped_weights`,
and the parameters' `weight_loader` copies each into its slot. A stacked parameter counts as loaded
only when every expert's shards arrived.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from keel.layers.fused_moe.router import RoutingConfig, select_experts
from keel.layers.fused_moe.routing_triton import routing_triton_supported, select_experts_triton
from keel.layers.fused_moe.torch_ref import fused_experts_torch
from keel.layers.fused_moe.triton_moe import fused_experts_triton, triton_available
from keel.models.weights import WeightLoadError, check_shape, set_weight_attrs

MOE_BACKENDS = ("auto", "torch", "triton")


class FusedMoE(nn.Module):
    """Routed experts. `forward(hidden, router_logits)` is called by the MoE block every step.

    `backend`: "torch" (reference), "triton" (fused kernel; CUDA, or CPU under TRITON_INTERPRET=1) or
    "auto" (Triton when `triton_available` for the input's device, else torch), decided per call so a
    model built once runs on whatever the process allows.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        routing: RoutingConfig,
        *,
        activation: str = "silu",
        backend: str = "auto",
        prefix: str = "",
    ) -> None:
        super().__init__()
        if backend not in MOE_BACKENDS:
            raise ValueError(f"MoE backend must be one of {MOE_BACKENDS}, got {backend!r}")
        if routing.num_experts != num_experts:
            raise ValueError(f"routing is for {routing.num_experts} experts, layer has {num_experts}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.routing = routing
        self.activation = activation
        self.backend = backend
        self.prefix = prefix
        self.last_backend: str | None = None  # which path the latest forward took (tests, logging)
        self.last_routing: str | None = None  # likewise for the routing ("triton" | "torch")
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
        """`residual` (e.g. shared experts' output) is added in the Triton path's combine kernel, saving a
        launch; the result equals `forward(hidden, router_logits, bias) + residual` in either path."""
        use_triton = self.backend == "triton" or (self.backend == "auto" and triton_available(hidden.device))
        # Routing follows the expert path: one kernel where the fused experts run (and it handles the
        # configuration), the torch reference otherwise.
        if use_triton and routing_triton_supported(self.routing):
            self.last_routing = "triton"
            topk_weights, topk_ids = select_experts_triton(router_logits, self.routing, e_score_correction_bias)
        else:
            self.last_routing = "torch"
            topk_weights, topk_ids = select_experts(router_logits, self.routing, e_score_correction_bias)
        if use_triton:
            self.last_backend = "triton"
            return fused_experts_triton(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                                        self.activation, residual)
        self.last_backend = "torch"
        out = fused_experts_torch(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.activation)
        return out if residual is None else out + residual

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
            f"top_k={self.routing.top_k}, backend={self.backend}"
        )
