"""DeepSeek MLP blocks: the dense SwiGLU MLP and the MoE block (router, routed experts, shared experts).

Routing follows the HF config: V2 scores with softmax, greedy or `group_limited_greedy`; V3 scores
with sigmoid plus `e_score_correction_bias`, group-limited (`noaux_tc`). `norm_topk_prob` renormalizes
the top-k weights and `routed_scaling_factor` multiplies them, for both (transformers 5.x ignores
`norm_topk_prob` for V2; with it set, keel follows vLLM and DeepSeek's own code and renormalizes).

The router's logits are the `router_gemm` custom op where one is bound (kernels-triton: float32 sums of
the 16-bit activations, no `x.float()` copy), else `F.linear(x.float(), weight)`.

Shared experts are fused into the routed experts where the layout allows (`shared_experts_fusion`, decided
once per model build): the shared MLP of intermediate S * I becomes S more experts of the `FusedMoE` layer,
always routed with weight 1.0, so the grouped GEMM reads their weights and the 3 kernels of a separate MLP
disappear. Otherwise (expert parallelism, attention DP, quantized checkpoints) the shared MLP runs on its
own and its output is added in the routed experts' combine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from keel.distributed.communication_op import (
    data_parallel_all_gather,
    expert_parallel_all_reduce,
    tensor_model_parallel_all_reduce,
)
from keel.forward_context import ForwardContext
from keel.layers import side_stream
from keel.layers.activation import get_act_and_mul_fn
from keel.layers.fused_moe import FusedMoE, FusedMoEParallelConfig, RoutingConfig
from keel.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from keel.models.interface import ModelBuildContext
from keel.models.weights import default_weight_loader, set_weight_attrs

logger = logging.getLogger("keel.models.deepseek")


class DeepseekV2MLP(nn.Module):
    """Dense SwiGLU MLP (first_k_dense_replace layers, and the shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, build: ModelBuildContext, prefix: str,
                 reduce_results: bool = True):
        super().__init__()
        quant = build.quant_method
        tp_size, tp_rank = build.tp_size, build.tp_rank
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, False, tp_size, tp_rank, quant_config=quant,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, False, tp_size, tp_rank, reduce_results, quant_config=quant,
            prefix=f"{prefix}.down_proj",
        )
        self.act_fn = get_act_and_mul_fn(act)
        self.down_proj.set_input_source(self.gate_up_proj, parts=2)  # act(gate) * up, per index
        self.down_proj.set_input_producer(self.act_fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden_size]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class MoEGate(nn.Module):
    """Router weight [num_experts, hidden] (kept in float32, as HF does) and V3's correction bias.

    `custom_ops`: the worker may bind a `router_gemm` kernel (see `keel.layers.custom_op`)."""

    custom_ops: ClassVar[tuple[str, ...]] = ("router_gemm",)
    bound_ops: Mapping[str, Callable[..., Any]] = MappingProxyType({})

    def __init__(self, num_experts: int, hidden_size: int, with_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=default_weight_loader)
        if with_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=torch.float32), requires_grad=False
            )
            set_weight_attrs(self.e_score_correction_bias, weight_loader=default_weight_loader)
        else:
            self.register_parameter("e_score_correction_bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden] -> [num_tokens, E] float32
        gemm = self.bound_ops.get("router_gemm")
        if gemm is not None:
            return gemm(x, self.weight)
        return F.linear(x.float(), self.weight)


@dataclass(frozen=True)
class SharedExpertsFusion:
    """Whether a model's MoE blocks fuse their shared experts into the routed experts, and why (logged)."""

    num_fused: int  # fused shared experts per MoE block (0: the shared MLP runs separately)
    reason: str


def shared_experts_fusion(config: Any, build: ModelBuildContext) -> SharedExpertsFusion:
    """Decided once per model build, the same for every MoE block (the checkpoint mapping depends on it).

    Fused: the routed experts are unquantized and split over TP only (each rank holds every expert, so the
    shared experts' intermediate slice is this rank's TP slice, as in the separate MLP). Not fused: expert
    parallelism or attention DP (shared experts run on every rank, routed ones on one), quantized
    checkpoints (the shared MLP's quantized linear layout is not the experts'), no shared experts."""
    n_shared = getattr(config, "n_shared_experts", None) or 0
    if not n_shared:
        return SharedExpertsFusion(0, "the model has no shared experts")
    if build.disable_shared_experts_fusion:
        return SharedExpertsFusion(0, "disable_shared_experts_fusion is set")
    if build.enable_expert_parallel or build.dp_size > 1:
        return SharedExpertsFusion(0, "expert parallelism / attention DP: the shared MLP runs on every rank")
    if build.quant_method is not None:
        return SharedExpertsFusion(0, "quantized checkpoint: the shared MLP keeps its quantized linear layers")
    return SharedExpertsFusion(n_shared, f"{n_shared} shared expert(s) ride in the routed grouped GEMM as "
                                         f"experts {config.n_routed_experts}..{config.n_routed_experts + n_shared - 1}")


def log_shared_experts_fusion(fusion: SharedExpertsFusion) -> None:
    """Called once by the model: which MoE path this build takes."""
    logger.info("DeepSeek MoE shared experts: %s (%s)", "fused" if fusion.num_fused else "separate MLP",
                fusion.reason)


def routing_config(config: Any, version: int, num_fused_shared_experts: int = 0) -> RoutingConfig:
    """The RoutingConfig of a DeepSeek V2 (`version=2`) or V3 (`version=3`) HF config."""
    num_experts = config.n_routed_experts
    common = {
        "num_experts": num_experts,
        "top_k": config.num_experts_per_tok,
        "renormalize": bool(getattr(config, "norm_topk_prob", False)),
        "routed_scaling_factor": float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
        "num_fused_shared_experts": num_fused_shared_experts,
    }
    if version == 3:
        return RoutingConfig(
            scoring_func=getattr(config, "scoring_func", "sigmoid"),
            use_grouped_topk=True,
            num_expert_group=config.n_group or 1,
            topk_group=config.topk_group or 1,
            **common,
        )
    method = getattr(config, "topk_method", "greedy") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported; known: greedy, group_limited_greedy")
    grouped = method == "group_limited_greedy"
    return RoutingConfig(
        scoring_func=getattr(config, "scoring_func", "softmax") or "softmax",
        use_grouped_topk=grouped,
        num_expert_group=config.n_group if grouped else None,
        topk_group=config.topk_group if grouped else None,
        **common,
    )


class DeepseekV2MoE(nn.Module):
    """Routed experts plus always-on shared experts; checkpoint names `mlp.gate.*`, `mlp.experts.{e}.*`,
    `mlp.shared_experts.*`. Called with the step's `ForwardContext` (attention data parallelism sizes
    its token exchange from it)."""

    takes_forward_context: ClassVar[bool] = True

    def __init__(self, config: Any, build: ModelBuildContext, version: int, prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        fused = shared_experts_fusion(config, build).num_fused
        routing = routing_config(config, version, fused)
        act = getattr(config, "hidden_act", "silu")
        self.gate = MoEGate(config.n_routed_experts, hidden, with_bias=version == 3)
        self.experts = FusedMoE(
            config.n_routed_experts,
            hidden,
            config.moe_intermediate_size,
            routing,
            activation=act,
            prefix=f"{prefix}.experts",
            parallel=FusedMoEParallelConfig.make(build.tp_size, build.tp_rank, build.enable_expert_parallel,
                                                 build.dp_size, build.dp_rank),
            quant_config=build.quant_method,
        )
        n_shared = getattr(config, "n_shared_experts", None) or 0
        # Under TP the shared and routed experts' partial sums are reduced together, once.
        self.tp_size = build.tp_size
        self.shared_experts = (
            DeepseekV2MLP(hidden, config.moe_intermediate_size * n_shared, act, build, f"{prefix}.shared_experts",
                          reduce_results=False)
            if n_shared and not fused
            else None
        )

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        # x: [num_tokens, hidden] -> [num_tokens, hidden]
        if self.experts.parallel.dp_size > 1:
            return self._forward_dp(x, ctx)
        # The shared experts' output rides into the routed experts' combine (one kernel on the Triton path);
        # inside a graph capture they run on a side stream beside the router and routed experts instead, joined
        # before one add (`keel.layers.side_stream`: the same rounding).
        shared, side = None, None
        if self.shared_experts is not None:
            side = side_stream.fork(x)
            with side_stream.on(side):
                shared = self.shared_experts(x)
        out = self.experts(x, self.gate(x), self.gate.e_score_correction_bias,
                           residual=shared if side is None else None)
        if side is not None:
            side_stream.join(side)
            out += shared
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out, self.tp_size)
        return out

    def _forward_dp(self, x: torch.Tensor, ctx: ForwardContext | None) -> torch.Tensor:
        """Attention DP, experts EP over the TP x DP ranks: every DP rank's tokens (padded to the step's
        largest count) are gathered, each rank runs its experts on all of them, one all-reduce over the EP
        group sums the experts (and each DP rank's shared experts, added at its own rows), and each rank
        keeps its rows. An idle DP rank joins with a dummy token (`ModelRunner`)."""
        n = x.shape[0]
        parallel = self.experts.parallel
        # ctx without counts: a profiling forward, where every rank runs the same shapes.
        pad = max(ctx.dp_num_tokens) if ctx is not None and ctx.dp_num_tokens else n
        start = parallel.dp_rank * pad  # this DP rank's rows
        tokens = data_parallel_all_gather(F.pad(x, (0, 0, 0, pad - n)), 0, parallel.dp_size)  # [dp * pad, hidden]
        shared = None
        if self.shared_experts is not None:  # this DP rank's tokens only (a partial sum over its TP ranks)
            shared = torch.zeros_like(tokens)
            shared[start:start + n] = self.shared_experts(x)
        out = self.experts(tokens, self.gate(tokens), self.gate.e_score_correction_bias, residual=shared)
        return expert_parallel_all_reduce(out, parallel.ep_size)[start:start + n]
