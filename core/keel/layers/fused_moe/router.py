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

    def __post_init__(self) -> None:
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


def select_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    cfg: RoutingConfig,
    e_score_correction_bias: torch.Tensor | None = None,  # [num_experts]
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, top_k] float32, ids [num_tokens, top_k] int64
    """The routing `cfg` describes; called by `FusedMoE.forward` every step."""
    if cfg.use_grouped_topk:
        return grouped_topk(router_logits, cfg, e_score_correction_bias)
    if e_score_correction_bias is not None:
        raise RoutingConfigError("e_score_correction_bias is only supported with group-limited routing")
    return fused_topk(router_logits, cfg)
