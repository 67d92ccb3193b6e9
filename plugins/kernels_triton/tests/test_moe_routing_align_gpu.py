"""The routing and alignment kernels compiled for real: lowered to sm_90 cubins without a GPU (the
interpreter accepts code the compiler rejects), and on a CUDA device run against the torch versions,
eagerly and replayed from a CUDA graph with fresh inputs (no host sync, static shapes)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from keel_kernels_triton.fused_moe.align import moe_align_block_size_triton
from keel_kernels_triton.fused_moe.routing import select_experts_triton
from triton_test_utils import capture_cuda_graph, run_sm90_compile_script

from keel.layers.fused_moe import RoutingConfig, moe_align_block_size_torch, select_experts

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

COMPILE_SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from keel_kernels_triton.fused_moe import align as A, router_gemm as G, routing as R

    def compile_(fn, sig, consts):
        if "PDL" in fn.arg_names:  # compiled as sm_90 launches it: programmatic dependent launch on
            sig, consts = {**sig, "PDL": "constexpr"}, {**consts, "PDL": True}
        out = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        assert "cubin" in out.asm

    route = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32",
             "stride_logits": "i32", "routed_scaling_factor": "fp32"}
    names = ("GROUP_SIZE", "NUM_GROUPS", "TOPK_GROUP", "TOP_K", "SOFTMAX", "HAS_BIAS", "GROUPED", "RENORMALIZE",
             "NUM_SHARED", "BLOCK_G", "BLOCK_EG", "BLOCK_K")
    route.update({k: "constexpr" for k in names})
    variants = [  # V2-Lite greedy (+ its 2 fused shared experts), V2 group-limited (non-power-of-2 groups),
        # V3 noaux_tc (+ 1 fused shared expert)
        (64, 1, 1, 6, True, False, False, False, 0, 1, 64, 8),
        (64, 1, 1, 6, True, False, False, False, 2, 1, 64, 8),
        (15, 4, 2, 6, True, False, True, True, 0, 4, 16, 8),
        (32, 8, 4, 8, False, True, True, True, 1, 8, 32, 8),
    ]
    for v in variants:
        compile_(R._jitted(False), route, dict(zip(names, v)))
    gemm = {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32", "num_tokens": "i32", "stride_x": "i32"}
    gemm.update({k: "constexpr" for k in ("E", "K", "USE_DOT", "SPLIT_W", "UPCAST_DOT", "BLOCK_T", "BLOCK_E",
                                          "BLOCK_K", "K_SLICE")})
    for tokens, experts, k in ((1, 64, 2048), (8, 64, 2048), (256, 64, 2048), (8192, 64, 2048), (4, 256, 7168),
                               (300, 256, 7168)):
        for split_w in (False, True):  # the split-weight bf16 tensor-core path past SMALL_T tokens
            launch = G.router_gemm_launch(tokens, experts, k, split_w=split_w)
            launch.pop("num_warps")
            compile_(G._jitted(False), gemm, {"E": experts, "K": k, "UPCAST_DOT": False, **launch})
    for ids_ty in ("*i32", "*i64"):
        align = {"ids_ptr": ids_ty, "sorted_ptr": "*i32", "expert_ids_ptr": "*i32", "total_ptr": "*i32",
                 "num_pairs": "i32", "max_padded": "i32", "NUM_EXPERTS": "constexpr", "BLOCK_M": "constexpr",
                 "BLOCK_E": "constexpr", "CHUNK": "constexpr", "TAIL": "constexpr"}
        for experts in (60, 256):
            block_e = 1 << (experts - 1).bit_length()
            compile_(A._jitted(False), align, {"NUM_EXPERTS": experts, "BLOCK_M": 16, "BLOCK_E": block_e,
                                               "CHUNK": A._CHUNK, "TAIL": A._TAIL})
            count = {"ids_ptr": ids_ty, "counts_ptr": "*i32", "num_pairs": "i32", "PAIRS": "constexpr",
                     "NUM_EXPERTS": "constexpr", "BLOCK_E": "constexpr", "CHUNK": "constexpr"}
            compile_(A._jitted(False, "count"), count, {"PAIRS": 64, "NUM_EXPERTS": experts, "BLOCK_E": block_e,
                                                        "CHUNK": A._CHUNK})
            scatter = {**align, "counts_ptr": "*i32", "PAIRS": "constexpr"}
            scatter = {k: scatter[k] for k in ("ids_ptr", "counts_ptr", "sorted_ptr", "expert_ids_ptr", "total_ptr",
                                               "num_pairs", "max_padded", "PAIRS", "NUM_EXPERTS", "BLOCK_M",
                                               "BLOCK_E", "CHUNK", "TAIL")}
            compile_(A._jitted(False, "scatter"), scatter, {"PAIRS": 64, "NUM_EXPERTS": experts, "BLOCK_M": 16,
                                                            "BLOCK_E": block_e, "CHUNK": A._CHUNK, "TAIL": A._TAIL})
    print("compiled")
''')


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests below run the kernels compiled")
def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    run_sm90_compile_script(COMPILE_SCRIPT)


CONFIGS = [
    (RoutingConfig(num_experts=64, top_k=6), False),  # DeepSeek-V2-Lite
    (RoutingConfig(num_experts=60, top_k=6, use_grouped_topk=True, num_expert_group=4, topk_group=2,
                   renormalize=True, routed_scaling_factor=16.0), False),
    (RoutingConfig(num_experts=256, top_k=8, scoring_func="sigmoid", use_grouped_topk=True, num_expert_group=8,
                   topk_group=4, renormalize=True, routed_scaling_factor=2.5), True),  # DeepSeek-V3
]


@needs_cuda
@pytest.mark.parametrize("cfg,with_bias", CONFIGS)
@pytest.mark.parametrize("tokens", [1, 4, 37, 300, 2000])
def test_cuda_routing_and_align_match_torch(cfg, with_bias, tokens):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, cfg.num_experts, device="cuda", generator=gen) * 2
    bias = torch.randn(cfg.num_experts, device="cuda", generator=gen) * 0.3 if with_bias else None
    w, ids = select_experts_triton(logits, cfg, bias)
    ref_w, ref_ids = select_experts(logits, cfg, bias)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(w, ref_w, atol=1e-5, rtol=1e-5)
    for got, ref in zip(moe_align_block_size_triton(ids, cfg.num_experts, 16),
                        moe_align_block_size_torch(ids, cfg.num_experts, 16), strict=True):
        assert torch.equal(got, ref)


@needs_cuda
@pytest.mark.parametrize("cfg,with_bias", CONFIGS)
@pytest.mark.parametrize("tokens", [3, 300])  # one align launch; two (the many-program path)
def test_cuda_graph_replay_with_fresh_logits(cfg, with_bias, tokens):
    logits = torch.randn(tokens, cfg.num_experts, device="cuda")
    bias = torch.randn(cfg.num_experts, device="cuda") * 0.3 if with_bias else None

    def step():
        w, ids = select_experts_triton(logits, cfg, bias)
        return (w, ids, *moe_align_block_size_triton(ids, cfg.num_experts, 16))

    graph, outs = capture_cuda_graph(step)  # compiled outside the capture
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        logits.copy_(torch.randn(tokens, cfg.num_experts, device="cuda", generator=gen))
        graph.replay()
        ref_w, ref_ids = select_experts(logits, cfg, bias)
        assert torch.equal(outs[1].long(), ref_ids)
        torch.testing.assert_close(outs[0], ref_w, atol=1e-5, rtol=1e-5)
        for got, ref in zip(outs[2:], moe_align_block_size_torch(ref_ids, cfg.num_experts, 16), strict=True):
            assert torch.equal(got, ref)
