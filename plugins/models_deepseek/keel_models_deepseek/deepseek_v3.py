"""DeepSeek-V3: DeepSeek-V2's architecture with sigmoid, bias-corrected, group-limited routing.

The differences are data (see `keel_models_deepseek.moe.routing_config`): routing scores are sigmoids,
`mlp.gate.e_score_correction_bias` biases which experts are picked (not their weights), groups are
ranked by the sum of their two best biased scores. `rope_interleave` (default True) chooses the rope
layout. Multi-token-prediction layers in the checkpoint are skipped.
"""

from __future__ import annotations

from typing import ClassVar

from keel_models_deepseek.deepseek_v2 import DeepseekV2ForCausalLM


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """Text generation for `DeepseekV3ForCausalLM` checkpoints."""

    version: ClassVar[int] = 3
