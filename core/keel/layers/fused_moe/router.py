"""Top-k expert routing for MoE layers (names mirror vLLM's `fused_topk` / `grouped_topk`).

Called by `FusedMoE.forward` once per step with the router logits of the step's tokens. Routing runs in
float32 whatever the activation dtype (HF keeps DeepSeek's gate in float32), and returns per token the
chosen expert ids and the weights their outputs are combined with.

Supported schemes:
- softmax greedy (DeepSeek-V2 `topk_method="greedy"`, Mixtral-style): top-k of softmax(logits);
- softmax group-limited (DeepSeek-V2 `group_limited_greedy`): keep the `topk_group` groups whose best
  expert scores highest, then top-k among their experts;
- sigmoid + `e_score_correction_bias` + group-limited (DeepSeek-V3 `noaux_tc`): groups ranked by the sum
  of their two best biased scores, experts chosen by biased score, weighted by the unbiased score.
`renormalize` (HF `norm_topk_prob`) rescales the k weights to sum to one; `routed_scaling_factor`
multiplies them afterwards.

Fused shared experts (`num_fused_shared_experts` S > 0, SGLang's "shared experts fusion"): the layer stores
S always-on experts after the routed ones, so every token's routes get S more columns, ids
num_experts .. num_experts + S - 1 with weight 1.0 (never renormalized nor scaled).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class RoutingConfigError(ValueError):
    """A MoE routing configuration that cannot work (group counts, top-k larger than the experts...)."""


@dataclass(frozen=True)
class RoutingConfig:
    """How a MoE layer picks experts; built once by the model from its HF config."""

    num_experts: int
    top_k: int
    scoring_func: str = "softmax"  # "softmax" | "sigmoid"
    use_grouped_topk: bool = False
    num_expert_group: int | None = None
    topk_group: int | None = None
    renormalize: bool = False
    routed_scaling_factor: float = 1.0
    num_fused_shared_experts: int = 0  # always-on experts stored after the routed ones (weight 1.0)

    @property
    def num_routes(self) -> int:
        """Columns of the routing's output per token: top_k routed plus the fused shared experts."""
        return self.top_k + self.num_fused_shared_experts

    def __post_init__(self) -> None:
        if not isinstance(self.num_fused_shared_experts, int) or self.num_fused_shared_experts < 0:
            raise RoutingConfigError(f"num_fused_shared_experts must be an int >= 0, got "
                                     f"{self.num_fused_shared_experts!r}")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise RoutingConfigError(f"scoring_func must be 'softmax' or 'sigmoid', got {self.scoring_func!r}")
        if not 0 < self.top_k <= self.num_experts:
            raise RoutingConfigError(f"top_k {self.top_k} must be in 1..num_experts ({self.num_experts})")
        if self.use_grouped_topk:
            groups, keep = self.num_expert_group, self.topk_group
            if not groups or not keep or self.num_experts % groups or not 0 < keep <= groups:
                raise RoutingConfigError(
                    f"group-limited routing needs n_group dividing n_routed_experts ({self.num_experts}) "
                    f"and 0 < topk_group <= n_group; got n_group={groups}, topk_group={keep}"
                )
            if keep * (self.num_experts // groups) < self.top_k:
                raise RoutingConfigError(
                    f"topk_group={keep} groups of {self.num_experts // groups} experts cannot supply "
                    f"top_k={self.top_k} experts"
                )


def _finish(
    weights: torch.Tensor,  # [num_tokens, top_k] float32
    ids: torch.Tensor,  # [num_tokens, top_k] int64
    cfg: RoutingConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    if cfg.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids


def fused_topk(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    cfg: RoutingConfig,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, top_k] float32, ids [num_tokens, top_k] int64
    """Greedy top-k over softmax (or sigmoid) scores of all experts."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
    weights, ids = torch.topk(scores, k=cfg.top_k, dim=-1)
    return _finish(weights, ids, cfg)


def grouped_topk(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    cfg: RoutingConfig,
    e_score_correction_bias: torch.Tensor | None = None,  # [num_experts] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, top_k] float32, ids [num_tokens, top_k] int64
    """Group-limited top-k: experts outside the `topk_group` best groups are never chosen."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
    n, groups = scores.shape[0], cfg.num_expert_group
    assert groups is not None and cfg.topk_group is not None  # checked by RoutingConfig
    if e_score_correction_bias is not None:
        choice = scores + e_score_correction_bias.float()
        group_scores = choice.view(n, groups, -1).topk(2, dim=-1).values.sum(dim=-1)  # [n, groups]
    else:
        choice = scores
        group_scores = choice.view(n, groups, -1).max(dim=-1).values
    group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    score_mask = group_mask.unsqueeze(-1).expand(n, groups, cfg.num_experts // groups).reshape(n, -1)
    choice = choice.masked_fill(score_mask == 0, float("-inf"))
    ids = torch.topk(choice, k=cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)  # the bias picks experts but never weighs them
    return _finish(weights, ids, cfg)


def append_shared_experts(
    weights: torch.Tensor,  # [num_tokens, top_k] float32
    ids: torch.Tensor,  # [num_tokens, top_k] int
    cfg: RoutingConfig,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, top_k + S]: the fused shared experts, weight 1.0
    s = cfg.num_fused_shared_experts
    if not s:
        return weights, ids
    n = ids.shape[0]
    shared = torch.arange(cfg.num_experts, cfg.num_experts + s, dtype=ids.dtype, device=ids.device)
    return (torch.cat([weights, weights.new_ones(n, s)], dim=1), torch.cat([ids, shared.expand(n, s)], dim=1))


def select_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    cfg: RoutingConfig,
    e_score_correction_bias: torch.Tensor | None = None,  # [num_experts]
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, num_routes] float32, ids [.., num_routes] int64
    """The routing `cfg` describes; called by `FusedMoE.forward` every step. `num_routes` is top_k plus
    the fused shared experts (`RoutingConfig.num_routes`)."""
    if cfg.use_grouped_topk:
        return append_shared_experts(*grouped_topk(router_logits, cfg, e_score_correction_bias), cfg)
    if e_score_correction_bias is not None:
        raise RoutingConfigError("e_score_correction_bias is only supported with group-limited routing")
    return append_shared_experts(*fused_topk(router_logits, cfg), cfg)
