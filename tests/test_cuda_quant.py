"""Quantization on a GPU (skipped without one): the compiled kernels against float references, and engines
on quantized checkpoints (keel's quantizer) against transformers on the dequantized weights.

- fp8_gemm (Triton W8A8, block and one-group-per-row scales), and every path an fp8 layer takes (weight-only
  Triton for small M, _scaled_mm, Triton W8A8, cuBLAS's block-scaled GEMM on sm90 and its load probe) vs
  float64 on the operands it multiplies; the fused activation quantization bit-equal to torch's; the
  fused-MoE quant GEMMs (block FP8 with the fused quantizer, int4 with a shuffled g_idx) vs the torch
  reference on the dequantized experts; the int4 prefill dequantize bit-equal to the reference's, and the
  prefill-sized int4 path through it.
- An fp8 Llama (block 128x128 and per-channel) and a GPTQ Llama on CUDA: the fp8 layers take their GPU
  paths (no per-step dequantization); float32 logprobs within the CPU tests' tolerances (W8A8 0.6,
  weight-only 1e-3: the int4 GEMM sums in another order than the reference), greedy tokens equal where
  transformers' top-2 margin exceeds 0.5; bf16 with _scaled_mm within 1.0.
- A block-FP8 DeepSeek-V3 (MoE experts in the quant grouped GEMM) vs transformers, 0.6; an fp8 KV cache
  in triton_flash, 0.3.
"""

from __future__ import annotations

import random

import pytest
import torch

from keel import SamplingParams
from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.layers.fp8_utils import dequant_per_token_group, per_token_group_quant_fp8
from keel.testing.checkpoints import make_checkpoint
from keel.testing.fidelity import assert_close_to_hf, run_requests

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
fp8_math = pytest.importorskip("keel_quantization.fp8_math")
quantizer = pytest.importorskip("keel_quantization.quantizer")

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
LLAMA = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "num_hidden_layers": 2}


def _sm89() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def _same_values(q: torch.Tensor, want: torch.Tensor) -> bool:
    """fp8 tensors equal value for value: a negative input that rounds to zero may be +0 from the kernel and
    -0 from torch (13 of 11,840 on the H200 at 3158d24), which dequantize alike."""
    return torch.equal(q.float(), want.float())


@pytest.mark.parametrize("m", [1, 7, 200])
def test_fp8_block_gemm_compiled(m):
    from keel_quantization.fp8_triton import fp8_gemm

    if not _sm89():
        pytest.skip("fp8 MMA needs sm89+")
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 320, device="cuda", generator=gen)
    w = torch.randn(576, 320, device="cuda", generator=gen) / 320**0.5  # partial blocks on both dims
    a_q, a_s = per_token_group_quant_fp8(x, 128)
    b_q, b_s = fp8_math.quantize_blocks(w, (128, 128))
    out = torch.full((m, 576), float("nan"), device="cuda", dtype=torch.bfloat16)
    fp8_gemm(a_q, a_s, b_q, b_s, 128, 128, torch.bfloat16, out=out)
    ref = dequant_per_token_group(a_q, a_s, 128, torch.float64) @ fp8_math.dequantize(b_q, b_s, (128, 128),
                                                                                        torch.float64).T
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("k,group,dtype", [(320, 128, torch.bfloat16), (4096, 4096, torch.bfloat16),
                                           (14336, 14336, torch.bfloat16), (7168, 128, torch.float16)])
def test_fused_activation_quant_compiled_is_bit_equal_to_torch(k, group, dtype):
    from keel_quantization.fp8_quant_triton import quant_fp8

    gen = torch.Generator(device="cuda").manual_seed(k)
    x = (torch.randn(37, k, device="cuda", generator=gen) * torch.logspace(-4, 4, k, device="cuda")).to(dtype)
    x[0] = 0
    q, s = quant_fp8(x, group)
    want_q, want_s = per_token_group_quant_fp8(x, group)
    assert torch.equal(s, want_s) and _same_values(q, want_q)
    if group == k:  # the chunked launch large tokens take at prefill sizes: the same bits
        from keel_quantization.fp8_quant_triton import QuantLaunch

        q, s = quant_fp8(x, group, launch=QuantLaunch("loop", 4, 2048))
        assert torch.equal(s, want_s) and _same_values(q, want_q)
    scale = torch.tensor([0.01], device="cuda")
    q, s = quant_fp8(x, k, scale)
    assert _same_values(q, fp8_math.to_fp8(x, scale))


@pytest.mark.parametrize("scheme_name,dtype,path", [
    ("channel", torch.bfloat16, "scaled_mm"), ("static", torch.bfloat16, "scaled_mm"),
    ("channel", torch.float16, "triton"), ("block", torch.bfloat16, "triton"), ("none", torch.bfloat16, "weight_only"),
])
def test_fp8_native_paths_match_a_float64_reference(scheme_name, dtype, path):
    """Each GPU path a layer takes, at M on both sides of the weight-only bound, against float64 on the
    operands that path multiplies (the fp8 activations it quantized, or x itself for weight-only): only
    the GEMM's accumulation and the output's rounding differ. Not against the bf16 reference path, whose
    own cuBLAS rounding (reduced-precision split-K reductions) depends on the algorithm cuBLAS picks."""
    from keel_quantization.fp8_linear import Fp8LinearMethod, Fp8Scheme
    from keel_quantization.fp8_native import SMALL_M_MAX_M, quantize_activations

    from keel.layers.linear import ReplicatedLinear
    from keel.models.loader import default_dtype

    if not _sm89():
        pytest.skip("fp8 MMA needs sm89+")
    scheme = {"channel": Fp8Scheme("dynamic_token"), "static": Fp8Scheme("static"), "none": Fp8Scheme("none"),
              "block": Fp8Scheme("dynamic_group", (128, 128), "weight_scale_inv")}[scheme_name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.device("cuda"), default_dtype(dtype):
        layer = ReplicatedLinear(320, 576, False, quant_config=Fp8LinearMethod(scheme, "fp8"))  # partial blocks
    w = torch.randn(576, 320, device="cuda", generator=gen) / 16
    q, s = fp8_math.quantize_per_row(w) if scheme.block is None else fp8_math.quantize_blocks(w, scheme.block)
    layer.weight.data.copy_(q)
    getattr(layer, scheme.scale_name).data.copy_(s)
    if scheme.activation == "static":
        layer.input_scale.data.fill_(4.0 / 448)
    layer.quant_method.process_weights_after_loading(layer)
    method = layer.quant_method
    assert method.native == path
    dense = fp8_math.dequantize(layer.weight, getattr(layer, scheme.scale_name), scheme.block, torch.float64)
    bounds = {method.small_m_max_m, method.small_m_max_m + 1, SMALL_M_MAX_M, SMALL_M_MAX_M + 1}
    for m in sorted({1, 7, 200} | bounds - {0, 1}):
        x = torch.randn(m, 320, device="cuda", generator=gen, dtype=dtype)
        got = layer(x)
        if method.native == "weight_only" or (m <= method.small_m_max_m and method.small_m == "weight_only"):
            a = x.double()
        else:
            a_q, a_s = quantize_activations(x, scheme.activation, scheme.block, getattr(layer, "input_scale", None))
            a = dequant_per_token_group(a_q, a_s, 128 if scheme.block else 320, torch.float64)
        torch.testing.assert_close(got.double(), a @ dense.T, atol=1e-2, rtol=1e-2)


def _cublas_block_here() -> bool:
    from keel_quantization import fp8_cublas_block

    return torch.cuda.get_device_capability() == (9, 0) and fp8_cublas_block.HAS_API


def _block_fp8_layer(n: int, k: int, dtype: torch.dtype, gen: torch.Generator):
    from keel_quantization.fp8_linear import Fp8LinearMethod, Fp8Scheme

    from keel.layers.linear import ReplicatedLinear
    from keel.models.loader import default_dtype

    with torch.device("cuda"), default_dtype(dtype):
        layer = ReplicatedLinear(k, n, True, prefix=f"test.{n}x{k}", quant_config=Fp8LinearMethod(
            Fp8Scheme("dynamic_group", (128, 128), "weight_scale_inv"), "fp8"))
    q, s = fp8_math.quantize_blocks(torch.randn(n, k, device="cuda", generator=gen) / k**0.5, (128, 128))
    layer.weight.data.copy_(q)
    layer.weight_scale_inv.data.copy_(s)
    layer.bias.data.copy_(torch.randn(n, device="cuda", generator=gen))
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(384, 640), (256, 2816), (1152, 1024), (576, 512)])
def test_block_fp8_cublas_path_matches_a_float64_reference(n, k, dtype):
    """cuBLAS's block-scaled GEMM (sm90, torch's F.scaled_mm) through the layer at M past the weight-only
    bound (33 and 1001 pad to a multiple of 4): against float64 on the operands it multiplies (the fp8
    activations and weights). K / 128 = 5 and 22 take the padded weight scales, 8 the loaded ones; 576 rows
    end in a partial block and stay on the Triton GEMM, the same comparison."""
    from keel_quantization import fp8_cublas_block
    from keel_quantization.fp8_native import SMALL_M_MAX_M

    if not _cublas_block_here():
        pytest.skip("cuBLAS's 1x128 x 128x128 fp8 GEMM needs sm90 and torch 2.10+ (F.scaled_mm)")
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    layer = _block_fp8_layer(n, k, dtype, gen)
    method = layer.quant_method
    want_path = "triton" if n % 128 else "cublas_block"
    assert method.native == want_path, fp8_cublas_block._probed
    if want_path == "cublas_block":
        assert method.native_scale.shape == (n // 128, -(-k // 512) * 4)
    dense = fp8_math.dequantize(layer.weight, layer.weight_scale_inv, (128, 128), torch.float64)
    for m in (SMALL_M_MAX_M + 1, 256, 1000, 1001):
        x = torch.randn(m, k, device="cuda", generator=gen, dtype=dtype)
        got = layer(x)
        assert got.shape == (m, n) and got.dtype == dtype
        a_q, a_s = per_token_group_quant_fp8(x, 128)
        want = dequant_per_token_group(a_q, a_s, 128, torch.float64) @ dense.T + layer.bias.double()
        # the Triton block GEMM's tolerance (test_fp8_block_gemm_compiled): at rtol 1e-2 one element of 12,672
        # (0.31, off by 0.024) failed on the H200 at 8c848ae -- float32 accumulation of 22 scaled K blocks
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


def test_cublas_block_probe_passes_on_this_gpu():
    """The load-time probe (one small GEMM per device, dtype and K padding, against float64) finds the
    recipe working on an sm90 with torch 2.10+: it is what routes the engine's block layers to cuBLAS."""
    from keel_quantization import fp8_cublas_block

    if not _cublas_block_here():
        pytest.skip("cuBLAS's 1x128 x 128x128 fp8 GEMM needs sm90 and torch 2.10+ (F.scaled_mm)")
    for dtype in (torch.bfloat16, torch.float32):
        for pad_k in (False, True):
            assert fp8_cublas_block._run_probe(torch.device("cuda"), dtype, pad_k) is None, (dtype, pad_k)


@pytest.mark.parametrize("kind", ["fp8_block", "int4"])
def test_fused_moe_quant_gemms_compiled(kind):
    from keel_kernels_triton.fused_moe.quant_gemm import fused_experts_quant_triton
    from keel_quantization import int4_math

    from keel.layers.fused_moe import fused_experts_torch
    from keel.layers.fused_moe.quant_config import FusedMoEQuantConfig

    if kind == "fp8_block" and not _sm89():
        pytest.skip("fp8 MMA needs sm89+")
    gen = torch.Generator(device="cuda").manual_seed(1)
    e, h, i, t, k = 8, 256, 128, 37, 2
    # fp8: float32 activations and dequantized weights, so the intermediate the down GEMM re-quantizes to
    # e4m3 differs from the reference's by accumulation order only; in bf16 its rounding moved ~3% of the
    # intermediate's values to a neighbouring e4m3 value (1/16 apart), 0.07 at the output
    dtype = torch.float32 if kind == "fp8_block" else torch.bfloat16
    x = torch.randn(t, h, device="cuda", generator=gen, dtype=dtype)
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, device="cuda", generator=gen) / i**0.5
    weights = torch.rand(t, k, device="cuda", generator=gen)
    ids = torch.stack([torch.randperm(e, device="cuda", generator=gen)[:k] for _ in range(t)])
    if kind == "fp8_block":
        q13 = [fp8_math.quantize_blocks(we, (128, 128)) for we in w13]
        q2 = [fp8_math.quantize_blocks(we, (128, 128)) for we in w2]
        d13 = torch.stack([fp8_math.dequantize(a, b, (128, 128), dtype) for a, b in q13])
        d2 = torch.stack([fp8_math.dequantize(a, b, (128, 128), dtype) for a, b in q2])
        from keel_quantization.fp8_moe import gated_input_quantizer
        from keel_quantization.fp8_quant_triton import quant_fp8

        b13, b2 = torch.stack([a for a, _ in q13]), torch.stack([a for a, _ in q2])
        quant = FusedMoEQuantConfig("fp8_block", torch.stack([b for _, b in q13]), torch.stack([b for _, b in q2]),
                                    block_shape=(128, 128), quantize_input=quant_fp8,
                                    quantize_gated_input=gated_input_quantizer(b13, 128))
        assert quant.quantize_gated_input is not None  # the fused silu + quantization, as the method hands it over
        act = lambda y: fp8_math.fake_quant_per_token_group(y, 128)
    else:
        def pack(w, group):
            n, kk = w.shape[1], w.shape[2]
            q = torch.randint(0, 16, (e, kk, n), device="cuda", generator=gen)
            z = torch.randint(1, 16, (e, kk // group, n), device="cuda", generator=gen).to(torch.bfloat16)
            s = (torch.rand(e, kk // group, n, device="cuda", generator=gen) * 0.02 + 0.005).to(torch.bfloat16)
            g = torch.stack([(torch.arange(kk, device="cuda") // group)[torch.randperm(kk, device="cuda",
                                                                                       generator=gen)]
                             for _ in range(e)]).int()
            d = torch.stack([int4_math.dequantize_int4(q[j], z[j], s[j], g[j], torch.bfloat16).T for j in range(e)])
            return torch.stack([int4_math.pack_rows(q[j]) for j in range(e)]), s, z, g, d
        b13, s13, z13, g13, d13 = pack(w13, 64)
        b2, s2, z2, g2, d2 = pack(w2, 32)
        quant = FusedMoEQuantConfig("int4", s13, s2, w13_zeros=z13, w2_zeros=z2, w13_g_idx=g13, w2_g_idx=g2)
        act = None
    ref = fused_experts_torch(x, b13, b2, weights, ids, expert_weights=lambda j: (d13[j], d2[j]),
                              quantize_input=act)
    out = fused_experts_quant_triton(x, b13, b2, weights, ids, "silu", None, quant)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def _engine(path, **kw) -> LLMEngine:
    args = {"model": str(path), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 16,
            "max_model_len": 256, "profile": "cuda", "max_num_seqs": 16, "gpu_memory_utilization": 0.3, **kw}
    return LLMEngine.from_engine_args(EngineArgs(**args))


@pytest.mark.parametrize("desc_act", [False, True], ids=["in-order", "desc-act"])
def test_int4_prefill_dequantize_compiled_is_bit_equal_and_multiplies(desc_act):
    from keel_quantization import int4_linear, int4_math
    from keel_quantization.int4_dequant_triton import int4_dequantize
    from keel_quantization.quantizer_int4 import int4_tensors

    k, n, m = 512, 328, int4_linear.DEQUANT_GEMM_MIN_M
    gen = torch.Generator().manual_seed(11)
    t, _ = int4_tensors("gptq", "x.weight", torch.randn(n, k, generator=gen), group_size=128, sym=False,
                        desc_act=desc_act, seed=11)
    qw, g_idx = t["x.qweight"].cuda(), t["x.g_idx"].to(torch.int32).cuda()
    s = t["x.scales"].to(torch.bfloat16).cuda()
    z = (int4_math.unpack_cols(t["x.qzeros"]) + 1).to(torch.bfloat16).cuda()
    want = int4_math.dequantize_int4(int4_math.unpack_rows(qw), z, s, g_idx, torch.bfloat16)  # [K, N]
    got = int4_dequantize(qw, s, z, g_idx, torch.bfloat16, 0 if desc_act else 128)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    method = int4_linear.Int4LinearMethod(int4_linear.Int4Format("gptq", 128, 1, desc_act))
    layer = torch.nn.Module()
    layer.qweight, layer.scales, layer.zeros, layer.g_idx = qw, s, z, g_idx
    method.group_in_order = 0 if desc_act else 128
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = method.apply(layer, x)
    assert method.last_backend == "triton_dequant"
    torch.testing.assert_close(out.float(), (x.double() @ want.double()).float(), rtol=2e-2, atol=2e-2)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    path = make_checkpoint("llama", tmp_path_factory.mktemp("cq") / "llama", **LLAMA)
    w = load_file(str(path / "model.safetensors"))
    w["lm_head.weight"] = w["lm_head.weight"] * 6  # clear greedy margins (as the CPU tests)
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("layout,options,atol,native", [
    ("fp8-block", {"block": (128, 128)}, 0.6, "cublas_block"),  # "triton" where cuBLAS's recipe is not
    ("fp8-channel", {}, 0.6, "triton"),
    ("gptq", {"group_size": 64, "sym": False, "desc_act": True}, 1e-3, None),
])
def test_quantized_llama_on_cuda_matches_transformers(llama, tmp_path, layout, options, atol, native):
    if layout.startswith("fp8") and not _sm89():
        pytest.skip("fp8 MMA needs sm89+")
    q = quantizer.quantize_checkpoint(llama, tmp_path / "q", layout, dequantized_to=tmp_path / "ref", **options)
    engine = _engine(q)
    layer = engine.core.worker.runner.model.model.layers[0].self_attn.qkv_proj
    if native == "cublas_block" and not _cublas_block_here():
        native = "triton"
    if native is not None:
        assert layer.quant_method.native == native  # fp8 GEMM on the stored weight, no per-step dequantize
        decoder = engine.core.worker.runner.model.model.layers[0]  # the activation quantization in its producers
        assert decoder.input_layernorm.fused_input_quant is not None
        assert decoder.mlp.act_fn.fused_input_quant is not None
    prompts = _prompts(3, [5, 33, 17, 70])
    stats = assert_close_to_hf(tmp_path / "ref", prompts, run_requests(engine, prompts, GREEDY), atol=atol,
                               min_margin=0.5)
    assert stats["near_ties"] < 16


def test_fp8_llama_bf16_takes_scaled_mm(llama, tmp_path):
    if not _sm89():
        pytest.skip("fp8 MMA needs sm89+")
    q = quantizer.quantize_checkpoint(llama, tmp_path / "q", "fp8-channel", dequantized_to=tmp_path / "ref")
    engine = _engine(q, dtype="bfloat16")
    assert engine.core.worker.runner.model.model.layers[0].mlp.down_proj.quant_method.native == "scaled_mm"
    prompts = _prompts(4, [9, 40])
    assert_close_to_hf(tmp_path / "ref", prompts, run_requests(engine, prompts, GREEDY), atol=1.0, min_margin=1.0)


def test_block_fp8_deepseek_v3_moe_on_cuda(tmp_path):
    from transformers import DeepseekV3Config

    if not _sm89():
        pytest.skip("fp8 MMA needs sm89+")
    cfg = DeepseekV3Config(vocab_size=300, hidden_size=256, intermediate_size=384, moe_intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                           num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=128,
                           q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
                           max_position_embeddings=512, n_group=1, topk_group=1, tie_word_embeddings=False)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(6)
    model.save_pretrained(tmp_path / "src")
    q = quantizer.quantize_checkpoint(tmp_path / "src", tmp_path / "q", "fp8-block", dequantized_to=tmp_path / "ref")
    engine = _engine(q)
    experts = engine.core.worker.runner.model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn and "fused_experts" in experts.bound_ops
    dense = engine.core.worker.runner.model.model.layers[0]  # its MLP's inputs quantized by their producers
    assert dense.post_attention_layernorm.fused_input_quant is not None
    assert dense.mlp.act_fn.fused_input_quant is not None
    prompts = _prompts(5, [7, 30])
    assert_close_to_hf(tmp_path / "ref", prompts, run_requests(engine, prompts, GREEDY), atol=0.6, min_margin=0.5)


def test_fp8_kv_cache_in_triton_flash_on_cuda(llama):
    """kv_cache_dtype fp8 in triton_flash, compiled: e4m3 keys and values (0.3, as the CPU tests)."""
    engine = _engine(llama, kv_cache_dtype="fp8", attention_backend="triton_flash")
    runner = engine.core.worker.runner
    assert runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert {layer.backend.name for layer in runner.attn_layers} == {"triton_flash"}
    prompts = _prompts(6, [5, 33, 17, 70])
    assert_close_to_hf(llama, prompts, run_requests(engine, prompts, GREEDY), atol=0.3, min_margin=0.5)


@pytest.mark.parametrize("scheme_name,dtype", [("channel", torch.bfloat16), ("channel", torch.float32),
                                               ("block", torch.bfloat16)])
def test_w8a8_one_token_alone_equals_its_row_among_41(scheme_name, dtype):
    """A W8A8 layer's output for one token is the same whether its step has 1 token (the W8A8 small-M GEMM)
    or 41 (the large-M path): both quantize the row alike (per token, or per token and group), so only the
    summation order and the output's rounding differ -- not the activations' fp8 rounding, which the
    weight-only small-M path it replaces skipped (float32: at least 10x the difference allowed here)."""
    from keel_quantization.fp8_linear import Fp8LinearMethod, Fp8Scheme

    from keel.layers.linear import ReplicatedLinear
    from keel.models.loader import default_dtype

    if not _sm89():
        pytest.skip("fp8 MMA needs sm89+")
    scheme = (Fp8Scheme("dynamic_token") if scheme_name == "channel"
              else Fp8Scheme("dynamic_group", (128, 128), "weight_scale_inv"))
    gen = torch.Generator(device="cuda").manual_seed(3)
    with torch.device("cuda"), default_dtype(dtype):
        layer = ReplicatedLinear(512, 576, False, quant_config=Fp8LinearMethod(scheme, "fp8"))
    w = torch.randn(576, 512, device="cuda", generator=gen) / 16
    q, s = fp8_math.quantize_per_row(w) if scheme.block is None else fp8_math.quantize_blocks(w, scheme.block)
    layer.weight.data.copy_(q)
    getattr(layer, scheme.scale_name).data.copy_(s)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.quant_method.small_m == "w8a8_small_m" and 1 <= layer.quant_method.small_m_max_m < 41
    x = torch.randn(41, 512, device="cuda", generator=gen, dtype=dtype)
    alone, among = layer(x[:1]).double(), layer(x)[:1].double()
    # the exact W8A8 product: the e4m3 activations the large-M path multiplies, in float64
    from keel_quantization.fp8_native import quantize_activations

    a_q, a_s = quantize_activations(x[:1], scheme.activation, scheme.block, None)
    a = a_q.double() * a_s.double().repeat_interleave(x.shape[1] // a_s.shape[1], dim=1)
    dense = fp8_math.dequantize(layer.weight, getattr(layer, scheme.scale_name), scheme.block, torch.float64)
    exact = a @ dense.T
    scale = exact.abs().max().item()
    errors = {"alone": (alone - exact).abs().max().item() / scale, "among": (among - exact).abs().max().item() / scale,
              "alone_vs_among": (alone - among).abs().max().item() / scale}
    # float32: the large-M GEMM was 8e-8 of |y| off the exact product on the H200; the small-M one, whose
    # sums are promoted to float32 after every wgmma, 5.3e-5 (1.9e-4 promoted every 128 inputs, 1e-3 never):
    # what is left is the fp8 wgmma's own sum over its 32 inputs
    tol, tol_exact = (1e-4, 2e-3) if dtype == torch.float32 else (1e-2, 1e-2)
    assert max(errors["alone"], errors["among"]) < tol_exact and errors["alone_vs_among"] < tol, errors
    if dtype == torch.float32:  # the unquantized activations' product is farther off than that
        assert (x[:1].double() @ dense.T - among).abs().max() > 10 * tol * among.abs().max()


@pytest.mark.parametrize("k", [4096, 14336])
def test_w8a8_small_m_sums_promoted_over_long_k(k):
    """The W8A8 small-M GEMM with one weight scale over K (per-channel) against the exact product of the
    same e4m3 values, at Llama-8B's K: the fp8 MMA's ~14-bit running sum is promoted to float32 after every
    wgmma (left to run over K, its error grew with K: ~1e-3 of |y| at K = 512)."""
    from keel_quantization.fp8_native import quantize_activations
    from keel_quantization.fp8_w8a8_small_m_triton import fp8_w8a8_small_m_gemm

    if not _sm89():
        pytest.skip("fp8 MMA needs sm89+")
    gen = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(256, k, device="cuda", generator=gen) / k**0.5
    q, s = fp8_math.quantize_per_row(w)
    x = torch.randn(2, k, device="cuda", generator=gen)
    y = fp8_w8a8_small_m_gemm(x, q, s[:, None], 1, k, "dynamic_token").double()
    a_q, a_s = quantize_activations(x, "dynamic_token", None, None)
    exact = (a_q.double() * a_s.double()) @ (q.double() * s.double()[:, None]).T
    err = ((y - exact).abs().max() / exact.abs().max()).item()
    assert err < 2e-3, err


# W8A8 is not batch-invariant, and cannot be without bitwise batch-invariant GEMMs: on the H200 the request's
# first token (a prefill, on the large-M path alone and among the others) had logprob -0.392 alone, -0.359
# among 40 (a3c606a), and token 2 -0.771 / -0.941 (2328ea6). benchmarks/w8a8_sensitivity.py shows why, on the
# CPU in float32 (cpu-w8a8-sensitivity-561fa62.json): noise of 1e-7 x |y| on this model's fp8 GEMM outputs
# moves its logprobs by up to 0.10 (0.04 on the first token) -- one activation pushed across an e4m3 rounding
# boundary is a whole 1/16 step in the next layer -- while the same weights with unquantized activations move
# by 2e-6. The H200's fp8 GEMMs differ from the exact product by ~5e-5 of |y| and by tile choice, so the bounds
# are that sensitivity's, not summation order's: logprobs within LP_TOL, tokens equal until one whose top-2
# margin is under NEAR_TIE (then the runner-up).
LP_TOL = 0.3
NEAR_TIE = 0.5


@pytest.mark.xfail(reason="bounds from the CPU sensitivity run (561fa62), not yet run on a GPU: the 0.1 / 0.2 "
                          "ones failed at token 2 on the H200 at 2328ea6 (0.17 apart); an XPASS says these hold "
                          "(it did on an H100 SXM at e3a41fb; not yet on the H200)",
                   strict=False)
def test_w8a8_decode_does_not_depend_on_the_batch(llama, tmp_path):
    """A per-channel W8A8 Llama in float32: one request decoded alone (M = 1, the W8A8 small-M GEMM) and
    among 40 others (M = 41, the Triton W8A8 GEMM) multiplies the same e4m3 activations -- both quantize
    per token (the weight-only small-M path it replaced computed on the unquantized ones) -- so its logprobs
    agree within LP_TOL and its tokens are equal up to a near-tie (see LP_TOL for why not closer; on the
    H200 this model's tokens part at index 8, 86 vs 222). float32, not bf16: a random-weight model's bf16
    rounding of different summation orders grows over a few layers and steps, whatever the GEMMs."""
    if not _sm89():
        pytest.skip("fp8 MMA needs sm89+")
    q = quantizer.quantize_checkpoint(llama, tmp_path / "q", "fp8-channel", dequantized_to=tmp_path / "ref")
    engine = _engine(q, max_num_seqs=48, enable_prefix_caching=False)
    method = engine.core.worker.runner.model.model.layers[0].mlp.down_proj.quant_method
    assert (method.native, method.small_m, method.small_m_max_m) == ("triton", "w8a8_small_m", 8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    mine = _prompts(7, [21])[0]
    alone = run_requests(engine, [mine], params, prefix="alone")["alone0"].outputs[0]
    crowd = run_requests(engine, [mine] + _prompts(8, [21, 9, 30, 16] * 10), params, prefix="crowd")
    among = crowd["crowd0"].outputs[0]
    for i, (a, b) in enumerate(zip(alone.token_ids, among.token_ids)):
        top = sorted((lp.logprob for lp in alone.logprobs[i].values()), reverse=True)
        if a != b:  # only a near-tie may flip, to the runner-up
            assert top[0] - top[1] < NEAR_TIE and b in alone.logprobs[i], (i, a, b, top)
            break
        assert abs(alone.logprobs[i][a].logprob - among.logprobs[i][b].logprob) < LP_TOL, (i, alone.logprobs[i],
                                                                                           among.logprobs[i])
