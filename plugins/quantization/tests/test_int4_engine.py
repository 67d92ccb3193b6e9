"""GPTQ and AWQ checkpoints (keel's quantizer, the real layouts) against transformers on the dequantized
weights. Weight-only, so the tolerance is tight: logprobs within 1e-4 (measured ~3e-6), greedy tokens
equal where transformers' top-2 margin exceeds MIN_MARGIN; plainly and through chunked prefill,
preemption and prefix-cache hits. Group sizes 32 / 64 / 128 (128 on a 128-wide model), sym and asym,
desc_act with g_idx."""

from __future__ import annotations

import pytest
import torch
from keel_quantization.quantizer import quantize_checkpoint
from quant_test_utils import GREEDY, MIN_MARGIN, check_layout, float_llama, make_engine

from keel.testing.fidelity import run_requests

TOLERANCE = (1e-4, MIN_MARGIN)
WIDE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}

CASES = {
    "gptq-g32-sym": ("gptq", {"group_size": 32, "sym": True}, False),
    "gptq-g64-asym-desc-act": ("gptq", {"group_size": 64, "sym": False, "desc_act": True}, False),
    "gptq-g128-sym-desc-act": ("gptq", {"group_size": 128, "sym": True, "desc_act": True}, True),
    "gptq-g128-asym": ("gptq", {"group_size": 128, "sym": False}, True),
    "awq-g32": ("awq", {"group_size": 32, "sym": False}, False),
    "awq-g128": ("awq", {"group_size": 128, "sym": False}, True),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4src")
    return {False: float_llama(root / "narrow"), True: float_llama(root / "wide", **WIDE)}


@pytest.mark.parametrize("case", list(CASES))
def test_int4_layout_matches_dequantized_reference(sources, tmp_path, case):
    layout, options, wide = CASES[case]
    quantized = quantize_checkpoint(sources[wide], tmp_path / "q", layout, dequantized_to=tmp_path / "ref", **options)
    check_layout(quantized, tmp_path / "ref", TOLERANCE)


@pytest.mark.parametrize("layout", ["gptq", "awq"])
def test_dummy_weights_in_the_int4_layout(sources, tmp_path, layout):
    """load_format="dummy" on a 4-bit config (what the GPU benchmark runs): packed words, in-range group
    ids and small scales; the model generates finite logprobs."""
    import json
    import math
    import shutil

    path = tmp_path / "dummy"
    shutil.copytree(sources[False], path)
    cfg = json.loads((path / "config.json").read_text())
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False} if layout == "gptq" \
        else {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}))
    engine = make_engine(path, load_format="dummy")
    layer = engine.core.worker.runner.model.model.layers[0].mlp.down_proj
    assert layer.qweight.dtype == torch.int32 and int(layer.g_idx.max()) == layer.scales.shape[0] - 1
    w = layer.quant_method.dequantize_weight(layer)
    assert 0.3 < float(w.std()) * math.sqrt(w.shape[1]) < 3  # ~N(0, 1/fan_in), as dense dummy weights
    out = run_requests(engine, [[5, 6, 7, 8]], GREEDY)["0"].outputs[0]
    assert all(math.isfinite(d[t].logprob) for d, t in zip(out.logprobs, out.token_ids))
