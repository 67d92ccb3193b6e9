"""PoolingParams (vLLM's name): what a pooling (embedding) request asks of the model's pooled output.

A pooling request computes its prompt and returns one vector; it samples no token. Validated on
construction (a `ParamError` names the field), like SamplingParams.
"""

from __future__ import annotations

from dataclasses import dataclass

from keel.engine.limits import ParamError


@dataclass(frozen=True)
class PoolingParams:
    # L2-normalize the pooled vector (vLLM's default for embeddings).
    normalize: bool = True
    # Matryoshka truncation: keel serves no model that declares it, so only None is accepted.
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ParamError("normalize", f"normalize must be a boolean, got {self.normalize!r}")
        if self.dimensions is not None:
            raise ParamError("dimensions", "dimensions (matryoshka truncation) is not supported by this model; "
                                           "remove the field")
