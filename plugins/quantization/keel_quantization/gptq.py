"""Quantization method "gptq": 4-bit GPTQ checkpoints (AutoGPTQ / GPTQModel layout), weight-only.

config.json `quantization_config`: `bits` (4), `group_size` (32, 64, 128, ... or -1), `sym`, `desc_act`
(inputs grouped in activation order through `g_idx`), `checkpoint_format` ("gptq": zeros stored minus
one; "gptq_v2": as they are), `lm_head` (must be false), `modules_in_block_to_quantize` (which layers are
quantized, if given). Calibration settings (damp_percent, true_sequential, dataset, ...) do not affect
inference and are accepted; any other field is an error naming it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from keel.quantization import QuantizationError
from keel_quantization.config_fields import check_fields
from keel_quantization.int4_linear import Int4Format
from keel_quantization.int4_support import Int4Config

# Calibration-time settings and transformers' GPTQConfig bookkeeping: no effect on how weights decode.
GPTQ_INERT = ("damp_percent", "damp_auto_increment", "static_groups", "true_sequential", "model_name_or_path",
              "model_file_base_name", "meta", "quantizer", "tokenizer", "dataset", "batch_size", "pad_token_id",
              "module_name_preceding_first_block", "block_name_to_quantize", "model_seqlen", "cache_block_outputs",
              "use_cuda_fp16", "use_exllama", "exllama_config", "max_input_length", "backend", "mse", "v2",
              "v2_alpha", "hyb_act", "pack_dtype", "adapter", "rotation", "is_marlin_format", "format")


class GPTQConfig(Int4Config):
    """Registered as `gptq` under the `quantization` kind."""

    name: ClassVar[str] = "gptq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        check_fields(cls.name, config, ("bits", "group_size", "sym", "desc_act", "checkpoint_format", "lm_head",
                                        "modules_in_block_to_quantize", "dynamic"), GPTQ_INERT)
        if config.get("bits") != 4:
            raise QuantizationError(f"gptq: bits={config.get('bits')!r} is not served (only 4)")
        group = config.get("group_size", 128)
        if not isinstance(group, int) or not (group == -1 or group > 0 and group % 8 == 0):
            raise QuantizationError(f"gptq: group_size {group!r} must be -1 or a positive multiple of 8")
        fmt_name = config.get("checkpoint_format", config.get("format", "gptq")) or "gptq"
        if fmt_name not in ("gptq", "gptq_v2"):
            raise QuantizationError(f"gptq: checkpoint_format {fmt_name!r} is not served (gptq, gptq_v2)")
        if config.get("format") not in (None, fmt_name):
            raise QuantizationError(f"gptq: format {config['format']!r} disagrees with checkpoint_format {fmt_name!r}")
        if config.get("pack_dtype") not in (None, "int32"):
            raise QuantizationError(f"gptq: pack_dtype {config['pack_dtype']!r} is not served (int32)")
        if config.get("lm_head"):
            raise QuantizationError("gptq: a quantized lm_head (lm_head: true) is not served")
        if config.get("dynamic"):
            raise QuantizationError("gptq: per-module overrides (dynamic) are not served")
        blocks = config.get("modules_in_block_to_quantize")
        modules = None if blocks is None else tuple(m for group_ in blocks for m in group_)
        fmt = Int4Format("gptq", group, zero_offset=1 if fmt_name == "gptq" else 0,
                         desc_act=bool(config.get("desc_act", False)))
        return cls(fmt, modules, names_skip=False)
