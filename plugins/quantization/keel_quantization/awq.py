"""Quantization method "awq": 4-bit AutoAWQ checkpoints in the GEMM layout, weight-only.

config.json `quantization_config`: `bits` (4), `group_size`, `zero_point` (true), `version` ("gemm"),
`modules_to_not_convert` (left unquantized). Other AutoAWQ versions (gemv, marlin, exllama) are errors.
"""

from __future__ import annotations

from typing import Any, ClassVar

from keel.quantization import QuantizationError
from keel_quantization.config_fields import check_fields
from keel_quantization.int4_linear import Int4Format
from keel_quantization.int4_support import Int4Config

# transformers' AwqConfig bookkeeping: fusing settings of its own backend, not how weights decode.
AWQ_INERT = ("backend", "do_fuse", "fuse_max_seq_len", "modules_to_fuse", "exllama_config")


class AWQConfig(Int4Config):
    """Registered as `awq` under the `quantization` kind."""

    name: ClassVar[str] = "awq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        check_fields(cls.name, config, ("bits", "w_bit", "group_size", "q_group_size", "zero_point", "version",
                                        "modules_to_not_convert"), AWQ_INERT)
        bits = config.get("bits", config.get("w_bit"))
        if bits != 4:
            raise QuantizationError(f"awq: bits={bits!r} is not served (only 4)")
        group = config.get("group_size", config.get("q_group_size", 128))
        if not isinstance(group, int) or group <= 0 or group % 8:
            raise QuantizationError(f"awq: group_size {group!r} must be a positive multiple of 8")
        if config.get("zero_point", True) is not True:
            raise QuantizationError("awq: zero_point=false is not served")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantizationError(f"awq: version {config.get('version')!r} is not served (only the GEMM layout)")
        if config.get("do_fuse"):
            raise QuantizationError("awq: do_fuse (transformers' fused modules) is not served")
        return cls(Int4Format("awq", group), tuple(config.get("modules_to_not_convert") or ()), names_skip=True)
