"""MoE routing in one Triton kernel: scores, group limit, top-k, renormalization and scaling per token.

`select_experts_triton` is what kernels-triton's `select_experts` custom op (ops.py) runs for a bound
`FusedMoE` layer; the op declines layers whose routing `routing_triton_supported` rejects, which keep the
core's torch routing (`keel.layers.fused_moe.router`, the reference). The kernel reproduces it step for
step in float32:

- scores: softmax over the experts (exp(x - max) / sum) or sigmoid; `choice` = scores (+ the correction
  bias when given). Experts are picked by `choice` and weighted by `scores`, as in `grouped_topk`.
- group limit: group score = max of the group's `choice`, or, with a bias, the sum of its two best
  `choice` values (DeepSeek-V3); the `topk_group` best groups survive, the other experts drop to -inf.
- top-k by repeated argmax, so ids come out in descending `choice` order like `torch.topk(sorted=True)`.
- renormalize (w / (sum + 1e-20)) then multiply by `routed_scaling_factor`.
- fused shared experts (`num_fused_shared_experts` S): columns TOP_K .. TOP_K + S - 1 get ids
  num_experts + s, weight 1.0.

Ties (equal `choice` values, or equal group scores) go to the lowest index. torch.topk does not document
its tie order, so on exactly tied inputs the two paths may pick different (equally valid) experts; with
continuous random logits ties do not occur.

One program per token (grid = (num_tokens,)): launch shape depends only on the input shape, nothing
is read back to the host, so the call is CUDA-graph capturable. Experts are laid out as a
[groups, experts per group] tile; ungrouped routing is one group of all experts.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from keel.layers.fused_moe.router import RoutingConfig, RoutingConfigError
from keel_kernels_triton.pdl import pdl_kwargs
from keel_kernels_triton.support import interpreter_enabled

# Largest expert tile one program holds (padded groups x padded experts per group), and the largest top-k
# it unrolls; configurations beyond these keep the torch routing.
MAX_EXPERT_TILE = 1024
MAX_TOP_K = 32


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _routing_kernel(
    logits_ptr,  # [num_tokens, num_experts] any float, unit stride over experts
    bias_ptr,  # [num_experts] float (read only when HAS_BIAS)
    weights_ptr,  # [num_tokens, TOP_K + NUM_SHARED] float32, written
    ids_ptr,  # [num_tokens, TOP_K + NUM_SHARED] int32, written
    stride_logits,
    routed_scaling_factor,
    GROUP_SIZE: tl.constexpr,  # experts per group (all experts when not grouped)
    NUM_GROUPS: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    NUM_SHARED: tl.constexpr,  # fused shared experts: ids NUM_GROUPS * GROUP_SIZE + s, weight 1.0
    BLOCK_G: tl.constexpr,
    BLOCK_EG: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch (keel_kernels_triton.pdl): wait before touching memory
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # Reductions go through tl.reduce with triton.language.standard's combine functions, never tl.max /
    # tl.sum: those are jitted helpers bound to the mode (compiled or interpreted) triton was first imported
    # in, while tl.reduce is a builtin that the interpreter patches (and runs in numpy for these combines).
    t = tl.program_id(0).to(tl.int64)
    ROUTES: tl.constexpr = TOP_K + NUM_SHARED  # columns of the outputs
    g = tl.arange(0, BLOCK_G)[:, None]  # [BLOCK_G, 1]
    j = tl.arange(0, BLOCK_EG)[None, :]  # [1, BLOCK_EG]
    valid = (g < NUM_GROUPS) & (j < GROUP_SIZE)
    expert = g * GROUP_SIZE + j  # [BLOCK_G, BLOCK_EG]
    neg_inf = float("-inf")
    big = 1 << 30
    x = tl.load(logits_ptr + t * stride_logits + expert, mask=valid, other=neg_inf).to(tl.float32)
    if SOFTMAX:
        top = tl.reduce(tl.reduce(x, 1, tl.standard._elementwise_max), 0, tl.standard._elementwise_max)
        p = tl.where(valid, tl.exp(x - top), 0.0)
        total = tl.reduce(tl.reduce(p, 1, tl.standard._sum_combine), 0, tl.standard._sum_combine)
        scores = p / total
    else:
        scores = 1.0 / (1.0 + tl.exp(-x))
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    else:
        choice = scores
    choice = tl.where(valid, choice, neg_inf)

    if GROUPED:
        best = tl.reduce(choice, 1, tl.standard._elementwise_max)  # [BLOCK_G]
        if HAS_BIAS:  # V3: sum of the two best; a tie for the best counts twice, as topk(2) does
            first = tl.reduce(tl.where(choice == best[:, None], j, big), 1, tl.standard._elementwise_min)
            second = tl.reduce(tl.where(j == first[:, None], neg_inf, choice), 1, tl.standard._elementwise_max)
            group_score = best + second
        else:
            group_score = best
        gid = tl.arange(0, BLOCK_G)
        group_score = tl.where(gid < NUM_GROUPS, group_score, neg_inf)
        keep = gid < 0  # all False
        for _ in tl.static_range(TOPK_GROUP):
            top_g = tl.reduce(group_score, 0, tl.standard._elementwise_max)
            pick = tl.reduce(tl.where(group_score == top_g, gid, big), 0, tl.standard._elementwise_min)
            keep = keep | (gid == pick)
            group_score = tl.where(gid == pick, neg_inf, group_score)
        choice = tl.where(keep[:, None], choice, neg_inf)

    kid = tl.arange(0, BLOCK_K)
    w = tl.full((BLOCK_K,), 0.0, dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        top_c = tl.reduce(tl.reduce(choice, 1, tl.standard._elementwise_max), 0, tl.standard._elementwise_max)
        hit = tl.where(choice == top_c, expert, big)
        e = tl.reduce(tl.reduce(hit, 1, tl.standard._elementwise_min), 0, tl.standard._elementwise_min)
        chosen = expert == e
        # a sum of one score and zeros: exact, no rounding
        s = tl.reduce(tl.reduce(tl.where(chosen, scores, 0.0), 1, tl.standard._sum_combine), 0,
                      tl.standard._sum_combine)
        w = tl.where(kid == i, s, w)
        tl.store(ids_ptr + t * ROUTES + i, e.to(tl.int32))
        choice = tl.where(chosen, neg_inf, choice)
    if RENORMALIZE:
        w = w / (tl.reduce(w, 0, tl.standard._sum_combine) + 1e-20)
    w = w * routed_scaling_factor
    tl.store(weights_ptr + t * ROUTES + kid, w, mask=kid < TOP_K)
    for s in tl.static_range(NUM_SHARED):
        tl.store(ids_ptr + t * ROUTES + TOP_K + s, NUM_GROUPS * GROUP_SIZE + s)
        tl.store(weights_ptr + t * ROUTES + TOP_K + s, 1.0)


@functools.cache
def _jitted(interpret: bool) -> Any:
    del interpret  # part of the cache key only: triton.jit reads TRITON_INTERPRET itself
    return triton.jit(_routing_kernel)


def routing_triton_supported(cfg: RoutingConfig) -> bool:
    """Whether the routing kernel handles `cfg` (asked once per layer when the op is bound).

    Declines: expert tiles above MAX_EXPERT_TILE, top_k above MAX_TOP_K, and group-limited routing with a
    single expert per group (the torch path's top-2 group score is undefined there and raises).
    """
    if cfg.top_k > MAX_TOP_K:
        return False
    groups = cfg.num_expert_group if cfg.use_grouped_topk else 1
    assert groups is not None  # checked by RoutingConfig
    group_size = cfg.num_experts // groups
    if cfg.use_grouped_topk and group_size < 2:
        return False
    return _next_pow2(groups) * _next_pow2(group_size) <= MAX_EXPERT_TILE


def select_experts_triton(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    cfg: RoutingConfig,
    e_score_correction_bias: torch.Tensor | None = None,  # [num_experts]
    out: tuple[torch.Tensor, torch.Tensor] | None = None,  # (weights, ids) to write instead of allocating
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, num_routes] float32, ids [.., num_routes] int32
    """`select_experts` in one kernel launch (ids are int32, as vLLM's fused routing returns them); the
    fused shared experts (`cfg.num_fused_shared_experts`) are appended in the same launch.

    The caller checks `routing_triton_supported(cfg)` and that Triton can run on the logits' device.
    """
    if e_score_correction_bias is not None and not cfg.use_grouped_topk:
        raise RoutingConfigError("e_score_correction_bias is only supported with group-limited routing")
    num_tokens, num_experts = router_logits.shape
    if num_experts != cfg.num_experts:
        raise RoutingConfigError(f"router logits have {num_experts} experts, routing expects {cfg.num_experts}")
    device = router_logits.device
    if out is None:
        weights = torch.empty(num_tokens, cfg.num_routes, dtype=torch.float32, device=device)
        ids = torch.empty(num_tokens, cfg.num_routes, dtype=torch.int32, device=device)
    else:
        weights, ids = out
        shape = (num_tokens, cfg.num_routes)
        if weights.shape != shape or ids.shape != shape or not (weights.is_contiguous() and ids.is_contiguous()):
            raise ValueError(f"routing buffers must be contiguous {list(shape)}; got {list(weights.shape)}, "
                             f"{list(ids.shape)}")
    if num_tokens == 0:
        return weights, ids
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    groups = cfg.num_expert_group if cfg.use_grouped_topk else 1
    assert groups is not None  # checked by RoutingConfig
    group_size = num_experts // groups
    has_bias = e_score_correction_bias is not None
    _jitted(interpreter_enabled())[(num_tokens,)](
        router_logits,
        e_score_correction_bias if has_bias else router_logits,
        weights,
        ids,
        router_logits.stride(0),
        float(cfg.routed_scaling_factor),
        GROUP_SIZE=group_size,
        NUM_GROUPS=groups,
        TOPK_GROUP=cfg.topk_group if cfg.use_grouped_topk else 1,
        TOP_K=cfg.top_k,
        SOFTMAX=cfg.scoring_func == "softmax",
        HAS_BIAS=has_bias,
        GROUPED=cfg.use_grouped_topk,
        RENORMALIZE=cfg.renormalize,
        NUM_SHARED=cfg.num_fused_shared_experts,
        BLOCK_G=_next_pow2(groups),
        BLOCK_EG=_next_pow2(group_size),
        BLOCK_K=_next_pow2(cfg.top_k),
        num_warps=1 if _next_pow2(groups) * _next_pow2(group_size) <= 256 else 4,
        **pdl_kwargs(weights),
    )
    return weights, ids
