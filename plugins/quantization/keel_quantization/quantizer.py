"""keel's own quantizer: rewrite a float checkpoint in a real quantized layout, plus its dequantized twin.

For tests and small experiments (not a calibration-quality tool): `quantize_checkpoint(src, dst, layout)`
writes `dst` with config.json's `quantization_config` and the tensors exactly as the released formats
store them, and (with `dequantized_to`) a float32 checkpoint holding the weights the quantized ones
stand for, so transformers can run the very same numbers as the reference. Static activation scales
come from running the float model (transformers) over a few random token sequences.

Layouts: "fp8-tensor" (vLLM fp8, per-tensor weight scale, static input scale), "fp8-channel" (per
output channel), "fp8-block" (DeepSeek-V3: [bn, bk] blocks, `weight_scale_inv`), "ct-fp8-channel"
(compressed-tensors W8A8: per channel weights, dynamic per-token activations), "ct-fp8-tensor"
(compressed-tensors, per-tensor weights and static activations), "ct-fp8-block"; "gptq" (4-bit,
`group_size`, `sym`, `desc_act` with g_idx) and "awq" (AutoAWQ GEMM, 4-bit with zero points).
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from keel_quantization import fp8_math
from keel_quantization.quantizer_int4 import int4_config, int4_tensors

# Linear weights the released formats quantize: every projection inside the decoder layers (DeepSeek's
# experts included, when asked), never the router (`mlp.gate`), embeddings, heads or MTP's eh_proj.
_LINEAR = re.compile(r"^model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$")
_EXPERT = re.compile(r"\.experts\.\d+\.")

LAYOUTS = ("fp8-tensor", "fp8-channel", "fp8-block", "ct-fp8-channel", "ct-fp8-tensor", "ct-fp8-block", "gptq",
           "awq")
INT4 = ("gptq", "awq")


def quantizable(name: str, experts: bool = True) -> bool:
    """Whether checkpoint tensor `name` is a linear weight the quantized layouts store quantized."""
    if not _LINEAR.match(name) or ".eh_proj." in name:
        return False
    return experts or not _EXPERT.search(name)


def _input_seed(name: str) -> int:
    """One activation order per input: projections reading the same input (q/k/v, gate/up; an expert's
    gate/up) share it, as GPTQ's desc_act derives the order from that input's statistics."""
    shared = re.sub(r"\.(q|k|v)_proj\.", ".qkv.", re.sub(r"\.(gate|up)_proj\.", ".gate_up.", name))
    return zlib.crc32(shared.encode())


def _calibrate_input_amax(src: Path, names: set[str], seed: int = 0) -> dict[str, float]:
    """max |input| of each linear module whose weight is in `names`, over random prompts (transformers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = []
    for mod_name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and f"{mod_name}.weight" in names:
            def hook(m: Any, inputs: tuple[torch.Tensor, ...], _out: Any, key: str = mod_name) -> None:
                amax[key] = max(amax.get(key, 0.0), float(inputs[0].abs().amax()))
            hooks.append(mod.register_forward_hook(hook))
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    with torch.no_grad():
        model(torch.randint(3, vocab, (4, 32), generator=g))
    for h in hooks:
        h.remove()
    return amax


def _fp8_tensors(layout: str, name: str, w: torch.Tensor, block: tuple[int, int],
                 input_amax: float | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(checkpoint tensors replacing `name`, dequantized weight) for one linear weight."""
    base = name[: -len("weight")]
    if layout.endswith("block"):
        q, scale = fp8_math.quantize_blocks(w, block)
        scale_name = "weight_scale_inv" if layout == "fp8-block" else "weight_scale"
        return {name: q, base + scale_name: scale}, fp8_math.dequantize(q, scale, block, torch.float32)
    if layout.endswith("channel"):
        q, scale = fp8_math.quantize_per_row(w)
        stored = scale[:, None] if layout.startswith("ct-") else scale
        out = {name: q, base + "weight_scale": stored}
    else:
        q, scale = fp8_math.quantize_per_tensor(w)
        out = {name: q, base + "weight_scale": scale.reshape(1) if layout.startswith("ct-") else scale}
        if input_amax is not None:
            out[base + "input_scale"] = torch.tensor(max(input_amax, 1e-6) / fp8_math.FP8_MAX)
            if layout.startswith("ct-"):
                out[base + "input_scale"] = out[base + "input_scale"].reshape(1)
    return out, fp8_math.dequantize(q, scale, None, torch.float32)


def _ct_fp8_config(layout: str, block: tuple[int, int], ignore: list[str], weight_only: bool) -> dict[str, Any]:
    strategy = layout.removeprefix("ct-fp8-")
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
               "group_size": None, "block_structure": list(block) if strategy == "block" else None,
               "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    if weight_only:
        acts = None
    elif strategy == "tensor":
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
    else:
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                "strategy": "group" if strategy == "block" else "token",
                "group_size": block[1] if strategy == "block" else None}
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                      "output_activations": None}},
        "ignore": ignore, "kv_cache_scheme": None, "version": "0.10.0",
    }


def _config(layout: str, block: tuple[int, int], ignore: list[str], weight_only: bool) -> dict[str, Any]:
    if layout.startswith("ct-"):
        return _ct_fp8_config(layout, block, ignore, weight_only)
    if weight_only:
        raise ValueError(f"layout {layout!r} has no weight-only variant (compressed-tensors layouts do)")
    cfg: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3",
                           "activation_scheme": "static" if layout == "fp8-tensor" else "dynamic"}
    if layout == "fp8-block":
        cfg["weight_block_size"] = list(block)
    if ignore:
        cfg["ignored_layers"] = ignore
    return cfg


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    layout: str,
    *,
    dequantized_to: str | Path | None = None,
    block: tuple[int, int] = (128, 128),
    experts: bool = True,
    skip: Callable[[str], bool] | None = None,
    weight_only: bool = False,
    group_size: int = 128,
    sym: bool = True,
    desc_act: bool = False,
) -> Path:
    """Write `src` (a float safetensors checkpoint) to `dst` in `layout` (see LAYOUTS); returns `dst`.

    `experts=False` leaves routed-expert weights unquantized; `skip(name)` leaves more weights
    unquantized (listed in the config's ignore list). `weight_only` (compressed-tensors layouts): no
    activation quantization. `group_size`, `sym`, `desc_act`: the 4-bit layouts'. With `dequantized_to`, also write the float32 checkpoint of the
    dequantized weights there (no quantization_config).
    """
    from keel.models.loader import iterate_safetensors

    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {LAYOUTS}")
    src, dst = Path(src), Path(dst)
    tensors = dict(iterate_safetensors(src))
    chosen = {n for n in tensors if quantizable(n, experts) and not (skip and skip(n))}
    ignored = sorted(n[: -len(".weight")] for n in tensors if quantizable(n, experts) and n not in chosen)
    amax = _calibrate_input_amax(src, chosen) if layout.endswith("tensor") and not weight_only else {}
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in chosen and layout in INT4:
            stored, deq = int4_tensors(layout, name, t, group_size=group_size, sym=sym, desc_act=desc_act,
                                         seed=_input_seed(name))
            quantized.update(stored)
            dequantized[name] = deq
        elif name in chosen:
            stored, deq = _fp8_tensors(layout, name, t, block, amax.get(name[: -len(".weight")]))
            quantized.update(stored)
            dequantized[name] = deq
        else:
            quantized[name] = dequantized[name] = t
    config = json.loads((src / "config.json").read_text())
    if layout in INT4:
        within_block = sorted({n.split(".", 3)[3][: -len(".weight")] for n in chosen}) if ignored else None
        qcfg = int4_config(layout, group_size=group_size, sym=sym, desc_act=desc_act, modules=within_block,
                           ignore=ignored)
    else:
        qcfg = _config(layout, block, ignored, weight_only)
    _write(src, dst, quantized, {**config, "quantization_config": qcfg})
    if dequantized_to is not None:
        _write(src, Path(dequantized_to), dequantized, config)
    return dst


def _write(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # tokenizer and generation files travel along
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
