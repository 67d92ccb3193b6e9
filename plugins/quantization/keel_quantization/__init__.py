"""keel plugin `quantization`: quantization methods registered under the `quantization` kind.

Only the manifest lives here; discovery imports this module, so it must not import torch.
Keys are the `quant_method` strings checkpoints carry in config.json's `quantization_config`.
"""

from keel.plugins.manifest import PluginManifest

__version__ = "0.1.0"


def manifest() -> PluginManifest:
    """Entry point `quantization` in group `keel.plugins`; called by plugin discovery."""
    return PluginManifest(
        name="quantization",
        version=__version__,
        core_api=">=1.0,<2",
        provides={
            "quantization": {
                "fp8": "keel_quantization.fp8:Fp8Config",
                "compressed-tensors": "keel_quantization.compressed_tensors:CompressedTensorsConfig",
                "gptq": "keel_quantization.gptq:GPTQConfig",
                "awq": "keel_quantization.awq:AWQConfig",
            }
        },
        description="FP8 (per-tensor, per-channel, block; online), compressed-tensors FP8, GPTQ and AWQ int4.",
    )
