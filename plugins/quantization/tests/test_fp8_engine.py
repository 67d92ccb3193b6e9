"""FP8 checkpoints (every layout keel's quantizer writes) against transformers on the dequantized weights.

Tolerances (float32 logprobs of the engine's tokens; logit margin above which the greedy token must
equal transformers'): weight-only 1e-4 / 0.5 (both sides multiply the very same dequantized weights;
measured 3e-6); dynamic fp8 activations 0.6 / 0.5 (activation rounding is error the reference does not
make; measured worst 0.19 per token, 0.32 per token-group, on this tiny model whose logits are sharpened
6x); static per-tensor activations 1.2 / 1.0 (a calibrated scale also clips outliers; measured 0.57, one
token flipped at margin 0.72). Each layout runs plainly and through chunked prefill, preemption and
prefix-cache hits.
"""

from __future__ import annotations

import pytest
from keel_quantization.quantizer import quantize_checkpoint
from quant_test_utils import GREEDY, MIN_MARGIN, check_layout, float_llama, make_engine, prompts_for

from keel.testing.fidelity import assert_close_to_hf, run_requests

WEIGHT_ONLY = (1e-4, MIN_MARGIN)
W8A8 = (0.6, MIN_MARGIN)
W8A8_STATIC = (1.2, 1.0)
BLOCK = (16, 16)  # the tiny model's 64/128-wide layers hold several blocks, like 128x128 on real ones

# name -> (quantizer layout, weight_only, (logprob tolerance, margin))
CASES = {
    "fp8-tensor-static": ("fp8-tensor", False, W8A8_STATIC),
    "fp8-channel": ("fp8-channel", False, W8A8),
    "fp8-block": ("fp8-block", False, W8A8),
    "ct-fp8-channel": ("ct-fp8-channel", False, W8A8),
    "ct-fp8-tensor-static": ("ct-fp8-tensor", False, W8A8_STATIC),
    "ct-fp8-block": ("ct-fp8-block", False, W8A8),
    "ct-fp8-channel-weight-only": ("ct-fp8-channel", True, WEIGHT_ONLY),
    "ct-fp8-block-weight-only": ("ct-fp8-block", True, WEIGHT_ONLY),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return float_llama(tmp_path_factory.mktemp("src") / "llama")


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_layout_matches_dequantized_reference(source, tmp_path, case):
    layout, weight_only, tolerance = CASES[case]
    quantized = quantize_checkpoint(source, tmp_path / "q", layout, dequantized_to=tmp_path / "ref",
                                    block=BLOCK, weight_only=weight_only)
    check_layout(quantized, tmp_path / "ref", tolerance)


def test_online_fp8_quantizes_an_unquantized_checkpoint(source, tmp_path):
    import torch
    from keel_quantization import fp8_math
    from keel_quantization.quantizer import quantizable
    from safetensors.torch import load_file, save_file

    # The reference: the same per-channel quantization the engine applies at load, dequantized.
    ref = tmp_path / "ref"
    ref.mkdir()
    for f in source.iterdir():
        (ref / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    for name, t in tensors.items():
        if quantizable(name):
            q, scale = fp8_math.quantize_per_row(t)
            tensors[name] = fp8_math.dequantize(q, scale, None, torch.float32)
    save_file(tensors, str(ref / "model.safetensors"), metadata={"format": "pt"})
    prompts = prompts_for(14, [6, 19, 11])
    engine = make_engine(source, quantization="fp8")
    layer = engine.core.worker.runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == fp8_math.FP8 and layer.weight_scale.shape == (layer.output_size,)
    results = run_requests(engine, prompts, GREEDY)
    assert_close_to_hf(ref, prompts, results, atol=W8A8[0], min_margin=W8A8[1])
