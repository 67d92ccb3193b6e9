"""The quantizer's 4-bit layouts: round-to-nearest per group, written as GPTQ or AutoAWQ GEMM store them.

Not GPTQ's error-compensating solver (the engine only needs the format to be exact, not the weights to
be good). `desc_act` draws a random activation order: group i holds inputs perm[i*g : (i+1)*g], and
`g_idx` says each input's group, as GPTQ checkpoints with act-order do.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from keel_quantization import int4_math


def _group_params(w_t: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales fp16 [groups, out], zeros int [groups, out]) for w_t [in, out] grouped by g_idx."""
    out = w_t.shape[1]
    index = g_idx.long()[:, None].expand_as(w_t)
    wmax = torch.full((groups, out), -math.inf).scatter_reduce_(0, index, w_t, "amax")
    wmin = torch.full((groups, out), math.inf).scatter_reduce_(0, index, w_t, "amin")
    if sym:
        amax = torch.maximum(wmax.abs(), wmin.abs()).clamp(min=1e-8)
        return (2 * amax / 15).half(), torch.full((groups, out), 8)
    wmin, wmax = wmin.clamp(max=0), wmax.clamp(min=0)
    scales = ((wmax - wmin).clamp(min=1e-8) / 15).half()
    # Zero 0 cannot be stored by GPTQ's v1 format (it keeps zero - 1 in 4 bits): use 1..15.
    zeros = torch.round(-wmin / scales.float()).clamp(1, 15).long()
    return scales, zeros


def int4_tensors(layout: str, name: str, w: torch.Tensor, *, group_size: int, sym: bool, desc_act: bool,
                 seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(checkpoint tensors replacing weight `name` [out, in], dequantized weight [out, in] float32)."""
    w_t = w.float().T.contiguous()  # [in, out]
    k = w_t.shape[0]
    g = k if group_size == -1 else group_size
    groups = math.ceil(k / g)
    if desc_act:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // g).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // g).to(torch.int32)
    scales, zeros = _group_params(w_t, g_idx, groups, sym)
    s, z = scales.float()[g_idx.long()], zeros[g_idx.long()]
    q = (torch.round(w_t / s) + z).clamp(0, 15).long()
    deq = int4_math.dequantize_int4(q, zeros, scales, g_idx, torch.float32).T.contiguous()
    base = name[: -len("weight")]
    if layout == "gptq":
        stored = {base + "qweight": int4_math.pack_rows(q), base + "qzeros": int4_math.pack_cols((zeros - 1) & 0xF),
                  base + "scales": scales, base + "g_idx": g_idx}
    else:
        order = int4_math.AWQ_ORDER
        stored = {base + "qweight": int4_math.pack_cols(q, order), base + "qzeros": int4_math.pack_cols(zeros, order),
                  base + "scales": scales}
    return stored, deq


def int4_config(layout: str, *, group_size: int, sym: bool, desc_act: bool, modules: list[str] | None,
                ignore: list[str]) -> dict[str, Any]:
    if layout == "gptq":
        cfg: dict[str, Any] = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act,
                               "sym": sym, "checkpoint_format": "gptq", "damp_percent": 0.01,
                               "true_sequential": True, "static_groups": False, "lm_head": False}
        if modules is not None:
            cfg["modules_in_block_to_quantize"] = [modules]
        return cfg
    if sym or desc_act:
        raise ValueError("the AutoAWQ GEMM layout is asymmetric (zero points) and has no activation order")
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": ignore or None}
