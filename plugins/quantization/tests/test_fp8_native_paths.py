"""The FP8 GPU paths through the layer's own dispatch, run on the CPU (Triton interpreted, torch's CPU
_scaled_mm): each path a layer can take -- the W8A8 small-M GEMM (or weight-only) for small M, _scaled_mm
and the Triton W8A8 GEMM above -- against the reference path on the same layer, at M on both sides of the
small-M bound; and which path each scheme chooses for which M (and why), and which large-M path a layer gets for a GPU capability,
shape and torch (cuBLAS's block-scaled GEMM or Triton), the GPU and torch faked.
tests/test_cuda_quant.py runs the same comparisons compiled."""

from __future__ import annotations

import logging

import pytest
import torch
from keel_quantization import fp8_cublas_block, fp8_math, fp8_native
from keel_quantization.fp8_linear import Fp8LinearMethod, Fp8Scheme
from keel_quantization.small_m_plan import w8a8_max_m

from keel.layers.linear import ReplicatedLinear
from keel.models.loader import default_dtype

pytest.importorskip("triton")
GPU_ONLY_BY_INTERPRETER = pytest.mark.skipif(torch.cuda.is_available(),
                                             reason="tests/test_cuda_quant.py runs it compiled")

BLOCK = Fp8Scheme("dynamic_group", (32, 32), "weight_scale_inv")


def fp8_layer(scheme: Fp8Scheme, dtype: torch.dtype, n: int = 80, k: int = 96) -> ReplicatedLinear:
    with default_dtype(dtype):
        layer = ReplicatedLinear(k, n, True, quant_config=Fp8LinearMethod(scheme, "fp8"))
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) / k**0.5
    q, s = fp8_math.quantize_per_row(w) if scheme.block is None else fp8_math.quantize_blocks(w, scheme.block)
    layer.weight.data.copy_(q)
    getattr(layer, scheme.scale_name).data.copy_(s)
    layer.bias.data.copy_(torch.randn(n, generator=g))
    if scheme.activation == "static":
        layer.input_scale.data.fill_(0.01)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def run(layer: ReplicatedLinear, x: torch.Tensor, native: str | None, small_m_max_m: int = 0,
        small_m: str | None = None) -> torch.Tensor:
    method = layer.quant_method
    method.native, method.small_m_max_m, method.small_m = native, small_m_max_m, small_m
    return layer(x)


@GPU_ONLY_BY_INTERPRETER
@pytest.mark.parametrize("scheme,dtype,native", [
    (Fp8Scheme("dynamic_token"), torch.bfloat16, "scaled_mm"),
    (Fp8Scheme("static"), torch.bfloat16, "scaled_mm"),
    (Fp8Scheme("dynamic_token"), torch.float32, "triton"),
    (BLOCK, torch.float32, "triton"),
])
def test_each_path_matches_the_reference_path(scheme, dtype, native):
    layer = fp8_layer(scheme, dtype)
    assert layer.quant_method.native is None  # CPU weights: the reference path
    gen = torch.Generator().manual_seed(5)
    bound = 4
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 output rounding of a different sum order
    for m in (1, bound, bound + 3):  # the small-M path, then the large-M one
        x = torch.randn(m, 96, generator=gen).to(dtype)
        want_w8a8 = run(layer, x, None)
        got = run(layer, x, native, bound, "w8a8_small_m")  # W8A8 at every M: the reference's numbers
        torch.testing.assert_close(got.float(), want_w8a8.float(), atol=tol, rtol=tol)
        if m <= bound:  # the weight-only fallback: no activation quantization, the dequantized weight times x
            dense = layer.quant_method.dequantize_weight(layer).float()
            want = torch.nn.functional.linear(x.float(), dense, layer.bias.float())
            got = run(layer, x, native, bound, "weight_only")
            torch.testing.assert_close(got.float(), want, atol=2e-2 if dtype != torch.float32 else 1e-5, rtol=2e-2)


@GPU_ONLY_BY_INTERPRETER
def test_weight_only_checkpoints_run_weight_only_at_every_m():
    layer = fp8_layer(Fp8Scheme("none"), torch.float32)
    x = torch.randn(70, 96)
    assert fp8_native.choose_small_m("weight_only", "none", None, 96) == (None, 0)  # one path at every M
    got = run(layer, x, "weight_only")
    want = run(layer, x, None)  # the reference: no activation quantization either
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_choice_per_m_is_made_once_from_the_large_m_path():
    bound = fp8_native.SMALL_M_MAX_M
    assert fp8_native.choose_small_m(None, "dynamic_token", None, 4096) == (None, 0)  # reference: no kernels at all
    for native, act, block in [("scaled_mm", "dynamic_token", None), ("scaled_mm", "static", None),
                               ("triton", "dynamic_group", (128, 128)), ("cublas_block", "dynamic_group", (128, 128))]:
        choice, max_m = fp8_native.choose_small_m(native, act, block, 4096)
        assert (choice.path, max_m) == ("w8a8_small_m", w8a8_max_m(block is None)) and act in choice.reason
    assert (w8a8_max_m(True), w8a8_max_m(False)) == (8, 16)  # measured: past them the large-M path is faster
    # a shape the W8A8 small-M GEMM does not take keeps the weight-only GEMM, saying why
    choice, max_m = fp8_native.choose_small_m("triton", "dynamic_token", None, 4104)
    assert (choice.path, max_m) == ("weight_only", bound) and "K 4104 is not a multiple of 16" in choice.reason
    assert fp8_native.choose_small_m("triton", "dynamic_group", (64, 192), 4096) == (None, 0)  # K tiles split groups
    assert fp8_native.choose_native(torch.empty(16, 16, dtype=fp8_math.FP8), "dynamic_token", None,
                                    torch.bfloat16).path is None  # CPU weights


@pytest.fixture
def fake_gpu(monkeypatch):
    """choose_native sees host weights on a GPU of the capability set, torch's block-wise API as set, and a
    probe GEMM that answers `probe_error` (recording its arguments)."""
    state = {"capability": (9, 0), "probe_error": None, "probes": []}
    monkeypatch.setattr(fp8_native, "_capability", lambda w: state["capability"])
    monkeypatch.setattr(fp8_native, "_HAS_TRITON", True)
    monkeypatch.setattr(fp8_cublas_block, "HAS_API", True)

    def probe(device, dtype, pad_k):
        state["probes"].append((dtype, pad_k))
        return state["probe_error"]

    monkeypatch.setattr(fp8_cublas_block, "probe", probe)
    return state


def _choose(n, k, block=(128, 128), dtype=torch.bfloat16, activation="dynamic_group"):
    return fp8_native.choose_native(torch.empty(n, k, dtype=fp8_math.FP8), activation, block, dtype)


def test_block_fp8_takes_cublas_where_it_fits(fake_gpu):
    for n, k, pad in [(6144, 4096, False), (4096, 14336, False), (512, 2816, True), (128, 128, True)]:
        choice = _choose(n, k)
        assert choice.path == "cublas_block", (n, k, choice)
        assert fake_gpu["probes"][-1] == (torch.bfloat16, pad)  # K / 128 not a multiple of 4: padded scales
    assert _choose(256, 512, dtype=torch.float32).path == "cublas_block"


@pytest.mark.parametrize("change,n,k,block,dtype,why", [
    ({}, 576, 512, (128, 128), torch.bfloat16, "partial 128 block"),  # DeepSeek's kv_a_proj
    ({}, 4096, 4160, (128, 128), torch.bfloat16, "partial 128 block"),  # K not a multiple of 128
    ({}, 4096, 4096, (64, 64), torch.bfloat16, "1x128 groups"),
    ({}, 4096, 4096, (128, 128), torch.float16, "model dtype"),
    ({"capability": (8, 9)}, 4096, 4096, (128, 128), torch.bfloat16, "sm89"),
    ({"capability": (10, 0)}, 4096, 4096, (128, 128), torch.bfloat16, "sm100"),
    ({"api": False}, 4096, 4096, (128, 128), torch.bfloat16, "no torch.nn.functional.scaled_mm"),
    ({"probe_error": "the probe GEMM failed: RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED"}, 4096, 4096, (128, 128),
     torch.bfloat16, "CUBLAS_STATUS_NOT_SUPPORTED"),
])
def test_block_fp8_keeps_triton_elsewhere_saying_why(fake_gpu, monkeypatch, change, n, k, block, dtype, why):
    fake_gpu.update({key: v for key, v in change.items() if key != "api"})
    if change.get("api") is False:
        monkeypatch.setattr(fp8_cublas_block, "HAS_API", False)
    choice = _choose(n, k, block, dtype)
    assert choice.path == "triton" and why in choice.reason, choice
    if "probe_error" not in change:
        assert fake_gpu["probes"] == []  # a layer that does not fit never runs the probe GEMM


def test_other_schemes_keep_their_paths(fake_gpu):
    assert _choose(4096, 4096, activation="none").path == "weight_only"
    assert _choose(4096, 4096, None, activation="dynamic_token").path == "scaled_mm"
    assert _choose(4096, 4096, None, torch.float32, activation="dynamic_token").path == "triton"
    fake_gpu["capability"] = (8, 0)
    assert _choose(4096, 4096).path is None
    assert fake_gpu["probes"] == []


def test_padded_weight_scales_are_made_once_and_only_where_needed():
    s = torch.rand(4, 32)
    assert fp8_native.native_scale("cublas_block", s) is s  # K / 128 a multiple of 4: as loaded
    assert fp8_native.native_scale("triton", s) is s
    s = torch.rand(4, 22)  # DSV2-Lite's shared experts' down_proj: K 2816
    padded = fp8_native.native_scale("cublas_block", s)
    assert padded.shape == (4, 24) and padded.is_contiguous()
    assert torch.equal(padded[:, :22], s) and torch.equal(padded[:, 22:], torch.ones(4, 2))


def test_each_choice_is_logged_once_per_model(caplog):
    log = fp8_native.NativeChoiceLog("fp8")
    cublas = fp8_native.NativeChoice("cublas_block", "cuBLAS")
    triton = fp8_native.NativeChoice("triton", "partial block")
    with caplog.at_level(logging.INFO, logger="keel.quantization.fp8"):
        for i in range(3):
            log.record(f"model.layers.{i}.self_attn.o_proj", (4096, 4096), cublas)
            log.record(f"model.layers.{i}.self_attn.kv_a_proj_with_mqa", (576, 2048), triton)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "model.layers.0.self_attn.o_proj" in lines[0] and "cublas_block" in lines[0] and "cuBLAS" in lines[0]
    assert "kv_a_proj_with_mqa" in lines[1] and "partial block" in lines[1]
    assert log.layers[cublas] == [f"model.layers.{i}.self_attn.o_proj" for i in range(3)]
