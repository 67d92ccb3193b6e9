"""Linear layers hand weight creation, loading and the matmul to the build's quantization method."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from keel_models_llama.qwen3 import Qwen3ForCausalLM
from llama_test_utils import build_context, hf_logits, prefill_logits, random_prompts
from torch import nn

from keel.models.interface import ModelBuildContext
from keel.models.loader import load_model
from keel.models.weights import set_weight_attrs
from keel.quantization import LinearLayerSpec, QuantizationMethod
from keel.testing.checkpoints import make_checkpoint


class HalfPrecisionWeights:
    """Test method: keeps weights in float16 after loading (a stand-in for a real quantized format)."""

    def __init__(self, log: dict) -> None:
        self.log = log

    def create_weights(self, module: nn.Module, layer: LinearLayerSpec) -> None:
        self.log.setdefault("specs", []).append(layer)
        w = nn.Parameter(
            torch.empty(sum(layer.output_partition_sizes), layer.input_size), requires_grad=False
        )
        module.register_parameter("weight", w)
        set_weight_attrs(w, weight_loader=module.weight_loader)  # reuse the layer's TP/stacking logic

    def process_weights_after_loading(self, module: nn.Module) -> None:
        self.log["processed"] = self.log.get("processed", 0) + 1
        module.weight.data = module.weight.data.half()

    def apply(self, module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self.log["applied"] = self.log.get("applied", 0) + 1
        return F.linear(x, module.weight.float(), bias)


class SkipMLPConfig:
    """Quantizes attention projections only, as configs with `ignored_layers` do."""

    name = "test-half"

    def __init__(self) -> None:
        self.log: dict = {}

    def get_quant_method(self, layer: LinearLayerSpec) -> QuantizationMethod | None:
        return None if ".mlp." in layer.prefix else HalfPrecisionWeights(self.log)


def test_quant_config_drives_attention_projections(tmp_path) -> None:
    path = make_checkpoint("qwen3", tmp_path / "q", attention_bias=True)
    quant = SkipMLPConfig()
    ctx = build_context(path)
    build = ModelBuildContext(**{**ctx.__dict__, "quant_method": quant})
    model = load_model(Qwen3ForCausalLM, build, path)

    prefixes = [s.prefix for s in quant.log["specs"]]
    assert prefixes == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("qkv_proj", "o_proj")]
    qkv = quant.log["specs"][0]
    assert qkv.output_partition_sizes == (64, 32, 32) and qkv.input_size == 64 and qkv.bias
    assert quant.log["processed"] == 4
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.weight.dtype == torch.float16
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float32

    prompts = random_prompts(300, [6, 11])
    ours = prefill_logits(model, prompts)
    assert quant.log["applied"] == 4
    ref = hf_logits(path, prompts)
    err = (ours - ref).abs().max()
    assert 0 < err < 0.05  # float16 weights: close to, but not bit-equal with, float32
