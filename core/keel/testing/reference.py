"""Dense float64 reference attention, computed from the logical K/V sequence (never from a cache).

Used by the attention-backend conformance suite (`keel.testing.attention`) and by kernel tests: the
reference knows nothing about blocks, slots or padding, so a paging bug cannot cancel out in it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def ref_attention(
    q: torch.Tensor,  # [query_len, num_heads, head_size]
    k: torch.Tensor,  # [context_len, num_kv_heads, head_size]: the whole context, new tokens last
    v: torch.Tensor,  # [context_len, num_kv_heads, head_size_v]
    *,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:  # [query_len, num_heads, head_size_v] float64
    """Attention of the last `query_len` tokens of a context over that context, in float64.

    Query j sits at position `context_len - query_len + j`. Causal: it sees key positions <= its own.
    Sliding window W (as HF Mistral/Qwen2): it sees key positions > its position - W.
    Query head h reads KV head `h // (num_heads // num_kv_heads)` (HF `repeat_kv` order).
    """
    query_len, num_heads, _ = q.shape
    context_len, num_kv_heads, _ = k.shape
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query_len > context_len:
        raise ValueError(f"query_len {query_len} exceeds context_len {context_len}")
    group = num_heads // num_kv_heads
    qd = q.to(torch.float64).transpose(0, 1)  # [H, q, D]
    kd = k.to(torch.float64).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
    vd = v.to(torch.float64).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, Dv]
    scores = (qd @ kd.transpose(1, 2)) * scale  # [H, q, ctx]
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    q_pos = torch.arange(context_len - query_len, context_len, device=q.device)[:, None]
    k_pos = torch.arange(context_len, device=q.device)[None, :]
    allowed = torch.ones(query_len, context_len, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs @ vd).transpose(0, 1)


def ref_varlen_attention(
    q: torch.Tensor,  # [sum(query_lens), num_heads, head_size]
    keys: Sequence[torch.Tensor],  # per request [context_len_i, num_kv_heads, head_size]
    values: Sequence[torch.Tensor],  # per request [context_len_i, num_kv_heads, head_size_v]
    query_lens: Sequence[int],
    **kwargs,
) -> torch.Tensor:  # [sum(query_lens), num_heads, head_size_v] float64
    """`ref_attention` per request of a flattened varlen batch; kwargs as for `ref_attention`."""
    if not (len(keys) == len(values) == len(query_lens)):
        raise ValueError("keys, values and query_lens must have one entry per request")
    if sum(query_lens) != q.shape[0]:
        raise ValueError(f"sum(query_lens)={sum(query_lens)} != q.shape[0]={q.shape[0]}")
    outs = []
    start = 0
    for k, v, n in zip(keys, values, query_lens):
        outs.append(ref_attention(q[start : start + n], k, v, **kwargs))
        start += n
    return torch.cat(outs, dim=0)
