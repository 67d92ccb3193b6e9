"""The fused MoE GEMM and `moe_sum` compiled for real: lowered to sm_90 cubins without a GPU for every
built-in tile config, the small-M (split-K) variants included (checking they fit an H200's shared memory),
and on a CUDA device run against torch in bf16 (the fused silu and the combine round exactly as the torch
path does) and replayed from a CUDA graph with fresh inputs."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch
import torch.nn.functional as F
from keel_kernels_triton.fused_moe.align import moe_align_block_size
from keel_kernels_triton.fused_moe.grouped_gemm import fused_experts_triton, invoke_fused_moe_kernel
from keel_kernels_triton.fused_moe.moe_sum import moe_sum
from keel_kernels_triton.fused_moe.tile_config import MoETileConfig
from triton_test_utils import capture_cuda_graph, run_sm90_compile_script

from keel.layers.fused_moe import fused_experts_torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Shared by the compile scripts: lower one `_fused_moe_kernel` variant of a DeepSeek-V2-Lite GEMM to sm_90.
COMPILE_PRELUDE = textwrap.dedent('''
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from keel_kernels_triton.fused_moe import grouped_gemm as M, moe_sum as S
    from keel_kernels_triton.fused_moe.tile_config import MoETileConfig, default_moe_tile_config

    H200_SMEM = 232448  # bytes of shared memory one block may opt into on sm_90
    def compile_(fn, sig, consts, warps=4, stages=3):
        if "PDL" in fn.arg_names:  # compiled as sm_90 launches it: programmatic dependent launch on
            sig, consts = {**sig, "PDL": "constexpr"}, {**consts, "PDL": True}
        out = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": warps, "num_stages": stages})
        assert "cubin" in out.asm
        assert out.metadata.shared <= H200_SMEM, (consts, warps, stages, out.metadata.shared)

    names = ("A_ROW_DIV", "A_SPLITS", "ACT_SILU", "MUL_ROUTED_WEIGHT", "DOT_PRECISION", "UPCAST_DOT", "SPLIT_K",
             "K_SLICE", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "EVEN_K", "USE_DOT", "WEIGHT_TMA",
             "GATED", "PAIR_BLOCKS")
    def compile_gemm(c, n, k, w13, a_splits, ty, group_m=1, act_silu=None, gated=False, pair_blocks=False):
        c_ty = "fp32" if c.split_k > 1 else ty
        sig = {"a_ptr": "*fp32" if a_splits > 1 else f"*{ty}", "b_ptr": f"*{ty}",
               "b_desc": f"tensordesc<{ty}[{c.block_n}, {c.block_k}]>" if c.weight_tma else "constexpr",
               "c_ptr": f"*{c_ty}", "topk_weights_ptr": "*fp32", "sorted_token_ids_ptr": "*i32",
               "expert_ids_ptr": "*i32", "num_tokens_post_padded_ptr": "*i32", "N": "i32", "K": "constexpr",
               "num_valid_tokens": "i32", "num_m_blocks": "i32"}
        sig.update({s: "i32" for s in ("stride_am", "stride_ak", "stride_as", "stride_be", "stride_bn",
                                       "stride_bk", "stride_cm", "stride_cn", "stride_cs")})
        sig.update({name: "constexpr" for name in names})
        per_split = -(-k // c.split_k)
        k_slice = -(-per_split // c.block_k) * c.block_k  # as invoke_fused_moe_kernel
        act_silu = (not w13) if act_silu is None else act_silu
        consts = dict(K=k, A_ROW_DIV=6 if w13 else 1, A_SPLITS=a_splits, ACT_SILU=act_silu,
                      MUL_ROUTED_WEIGHT=not w13, DOT_PRECISION="ieee" if ty == "fp32" else "tf32",
                      UPCAST_DOT=False, SPLIT_K=c.split_k, K_SLICE=k_slice if c.split_k > 1 else k,
                      BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=group_m,
                      EVEN_K=c.split_k == 1 and k % c.block_k == 0, USE_DOT=c.kernel == "dot",
                      WEIGHT_TMA=c.weight_tma, GATED=gated, PAIR_BLOCKS=pair_blocks)
        if gated:
            consts["ACT_SILU"] = False
        if not c.weight_tma:
            consts["b_desc"] = None
        compile_(M._jitted(False), sig, consts, c.num_warps, c.num_stages)
''')

COMPILE_SCRIPT = COMPILE_PRELUDE + textwrap.dedent('''
    for dtype, ty in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        seen = set()
        for tokens in (1, 16, 64, 256, 4096):  # DeepSeek-V2-Lite: both GEMMs, every heuristic regime
            for n, k, w13 in ((2816, 2048, True), (2048, 1408, False)):
                c = default_moe_tile_config(tokens, 64, n, k, 6, dtype)
                # the w2 GEMM of a split call reads the w13 GEMM's float32 partials
                a_splits = 1 if w13 else default_moe_tile_config(tokens, 64, 2816, 2048, 6, dtype).split_k
                if (c, w13, a_splits) in seen:
                    continue
                seen.add((c, w13, a_splits))
                compile_gemm(c, n, k, w13, a_splits, ty, pair_blocks=tokens <= M.PAIR_BLOCKS_MAX_TOKENS)
                if tokens == 4096 and ty == "bf16":  # prefill sizes: the grouped program order too
                    compile_gemm(c, n, k, w13, a_splits, ty, group_m=8)
        for splits in (1, 4):
            d_ty = "fp32" if splits > 1 else ty
            sum_sig = {"down_ptr": f"*{d_ty}", "out_ptr": f"*{ty}", "residual_ptr": f"*{ty}", "H": "i32",
                       "stride_ds": "i32", "stride_dt": "i32", "stride_dk": "i32", "stride_ot": "i32",
                       "stride_rt": "i32", "TOP_K": "constexpr", "SPLITS": "constexpr", "HAS_RESIDUAL": "constexpr",
                       "BLOCK_H": "constexpr"}
            for res in (False, True):
                compile_(S._jitted_sum(False), sum_sig, {"TOP_K": 6, "SPLITS": splits, "HAS_RESIDUAL": res,
                                                         "BLOCK_H": 512})
    print("compiled")
''')

# The decode-size variants (gemv loop, TMA weight tiles, split gemv), as benchmarks/h200_moe_decode_sweep.py
# times them: the largest tiles of each kind, for both GEMMs (bf16).
DECODE_COMPILE_SCRIPT = COMPILE_PRELUDE + textwrap.dedent('''
    variants = [MoETileConfig(1, 16, 512, 4, 3, kernel="gemv"), MoETileConfig(8, 16, 128, 8, 3, kernel="gemv"),
                MoETileConfig(2, 32, 256, 4, 1, kernel="gemv"),
                MoETileConfig(2, 32, 256, 4, 3, kernel="gemv", weight_tma=True),
                MoETileConfig(1, 32, 256, 4, 3, split_k=4, kernel="gemv"),
                MoETileConfig(16, 64, 128, 4, 6, weight_tma=True), MoETileConfig(16, 32, 256, 4, 4, weight_tma=True),
                MoETileConfig(64, 128, 128, 8, 3, weight_tma=True)]
    for c in variants:
        for n, k, w13 in ((2816, 2048, True), (2048, 1408, False)):
            compile_gemm(c, n, k, w13, c.split_k if not w13 else 1, "bf16")
    for c in variants[2], variants[5]:  # down GEMMs after a separate silu_and_mul ("FUSED_ACT": false)
        compile_gemm(c, 2048, 1408, False, 1, "bf16", act_silu=False)
    for c in variants[:4] + variants[5:]:  # w13 GEMMs with the silu epilogue ("ACT_EPILOGUE"): N is the
        compile_gemm(c, 1408, 2048, True, 1, "bf16", gated=True)  # intermediate, two accumulators
        compile_gemm(c, 2048, 1408, False, 1, "bf16", act_silu=False)  # and the plain down GEMM after it
    print("compiled")
''')


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests below run the kernels compiled")
def test_kernels_compile_for_sm90_within_shared_memory():
    pytest.importorskip("triton.backends.nvidia")
    run_sm90_compile_script(COMPILE_SCRIPT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests below run the kernels compiled")
def test_decode_variants_compile_for_sm90_within_shared_memory():
    pytest.importorskip("triton.backends.nvidia")
    run_sm90_compile_script(DECODE_COMPILE_SCRIPT)


def _inputs(tokens, hidden=256, inter=192, experts=64, top_k=6, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5).to(dtype)
    w = torch.rand(tokens, top_k, device="cuda", generator=gen)
    # experts 48.. stay idle
    ids = torch.stack([torch.randperm(48, device="cuda", generator=gen)[:top_k] for _ in range(tokens)])
    return x, w13, w2, w, ids


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("cfg", [None, MoETileConfig(16, 32, 256, 4, 5), MoETileConfig(64, 128, 64, 8, 3),
                                 MoETileConfig(16, 64, 64, 4, 4, split_k=3),
                                 MoETileConfig(1, 32, 256, 4, 3, kernel="gemv"),
                                 MoETileConfig(2, 32, 256, 4, 3, kernel="gemv", weight_tma=True),
                                 MoETileConfig(16, 64, 128, 4, 4, weight_tma=True)],
                         ids=["default", "m16k256", "m64n128", "small_m_split3", "gemv_m1", "gemv_m2_tma", "dot_tma"])
def test_cuda_bf16_matches_torch(tokens, cfg):
    x, w13, w2, w, ids = _inputs(tokens, seed=tokens)
    ref = fused_experts_torch(x.float(), w13.float(), w2.float(), w, ids)
    res = torch.randn_like(x)
    out = fused_experts_triton(x, w13, w2, w, ids, "silu", res, tile_configs=None if cfg is None else (cfg, cfg))
    torch.testing.assert_close(out.float(), ref + res.float(), atol=3e-2, rtol=3e-2)


@needs_cuda
def test_cuda_float32_tiles_match_torch():
    x, w13, w2, w, ids = _inputs(37, dtype=torch.float32)
    torch.testing.assert_close(fused_experts_triton(x, w13, w2, w, ids), fused_experts_torch(x, w13, w2, w, ids),
                               atol=1e-5, rtol=1e-5)


@needs_cuda
def test_cuda_fused_silu_and_sum_round_like_torch():
    tokens, top_k, inter = 9, 6, 192
    _, _, w2, w, ids = _inputs(tokens)
    gate_up = torch.randn(tokens * top_k, 2 * inter, device="cuda").bfloat16() * 3
    cfg = MoETileConfig(16, 64, 128, 4, 4)
    sorted_ids, expert_ids, total = moe_align_block_size(ids, w2.shape[0], cfg.block_m)
    outs = []
    for fused in (True, False):
        a = gate_up if fused else F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        down = torch.full((tokens * top_k, w2.shape[1]), float("nan"), device="cuda", dtype=torch.bfloat16)
        invoke_fused_moe_kernel(a, w2, down, w.reshape(-1), sorted_ids, expert_ids, total, 1, cfg,
                                act_silu=fused)
        outs.append(down)
    # identical A operands up to rare one-ulp differences of silu's exp; the GEMMs then agree
    torch.testing.assert_close(outs[0], outs[1], atol=1e-2, rtol=1e-2)
    assert (outs[0] == outs[1]).float().mean() > 0.98
    down = outs[1].view(tokens, top_k, -1)
    res = torch.randn(tokens, down.shape[2], device="cuda").bfloat16()
    got, ref = moe_sum(down, residual=res), down.sum(1) + res
    torch.testing.assert_close(got, ref, atol=1e-2, rtol=1e-2)
    assert (got == ref).float().mean() > 0.99  # float32 sums in another order may round apart, rarely


@needs_cuda
@pytest.mark.parametrize("cfg", [MoETileConfig(16, 64, 128, 4, 4, act_epilogue=True),
                                 MoETileConfig(16, 128, 128, 4, 3, weight_tma=True, act_epilogue=True),
                                 MoETileConfig(64, 128, 64, 8, 3, weight_tma=True, act_epilogue=True),
                                 MoETileConfig(1, 16, 128, 4, 3, kernel="gemv", act_epilogue=True)],
                         ids=["dot", "dot_tma", "m64_tma", "gemv_m1"])
def test_cuda_act_epilogue_rounds_like_torch(cfg):
    """The w13 GEMM's silu epilogue stores torch's F.silu(gate) * up of the gate_up the plain GEMM stores
    (up to silu's exp one ulp apart, rarely), and the whole MoE matches torch."""
    tokens, inter = 9, 192
    x, w13, _, w, ids = _inputs(tokens)
    plain = dataclasses.replace(cfg, act_epilogue=False)
    sorted_ids, expert_ids, total = moe_align_block_size(ids, w13.shape[0], cfg.block_m)
    rows = ids.numel()
    gate_up = torch.empty(rows, 2 * inter, device="cuda", dtype=torch.bfloat16)
    invoke_fused_moe_kernel(x, w13, gate_up, None, sorted_ids, expert_ids, total, 6, plain)
    act = torch.full((rows + 3, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    invoke_fused_moe_kernel(x, w13, act[:rows], None, sorted_ids, expert_ids, total, 6, cfg, gated=True)
    assert act[rows:].isnan().all()
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(act[:rows], want, atol=1e-2, rtol=1e-2)
    assert (act[:rows] == want).float().mean() > 0.98
    for n in (1, 5, 64, 300):
        x, w13, w2, w, ids = _inputs(n, seed=n)
        res = torch.randn_like(x)
        out = fused_experts_triton(x, w13, w2, w, ids, "silu", res, tile_configs=(cfg, plain))
        ref = fused_experts_triton(x, w13, w2, w, ids, "silu", res, tile_configs=(plain, plain))
        torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)


@needs_cuda
@pytest.mark.parametrize("tile", [MoETileConfig(16, 64, 64, 4, 4, 1), MoETileConfig(16, 64, 64, 4, 4, 4),
                                  MoETileConfig(1, 16, 128, 4, 3, kernel="gemv"),
                                  MoETileConfig(16, 128, 128, 4, 3, weight_tma=True, fused_act=False),
                                  MoETileConfig(16, 128, 128, 4, 3, weight_tma=True, act_epilogue=True)],
                         ids=["split1", "split4", "gemv", "tma_unfused", "tma_epilogue"])
def test_cuda_graph_replay_with_fresh_routing(tile):
    x, w13, w2, w, ids = _inputs(4)
    res = torch.randn_like(x)
    tiles = (tile,) * 2

    def step():
        return fused_experts_triton(x, w13, w2, w, ids, "silu", res, tile_configs=tiles)

    graph, out = capture_cuda_graph(step)  # compiled outside the capture
    for seed in range(3):
        fresh = _inputs(4, seed=100 + seed)
        x.copy_(fresh[0])
        w.copy_(fresh[3])
        ids.copy_(fresh[4])
        graph.replay()
        torch.testing.assert_close(out, step(), atol=0, rtol=0)
