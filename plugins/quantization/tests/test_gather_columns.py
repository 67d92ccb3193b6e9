"""Act order's activation gather (`gather_columns`, a PDL launch like the int4 GEMMs around it): exactly x[:, perm]
for odd sizes and either index dtype, on the interpreter here and compiled on a GPU; what it cannot take is refused
by name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
gc = pytest.importorskip("keel_quantization.gather_columns")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m,k", [(1, 96), (3, 1000), (2, 2048 + 64)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_it_is_the_gathered_columns(m, k, index_dtype):
    g = torch.Generator().manual_seed(m * k)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    x = torch.randn(m, k + 5, generator=g).to(dtype).to(DEVICE)[:, :k]  # rows strided past K
    perm = torch.randperm(k, generator=g).to(index_dtype).to(DEVICE)
    assert torch.equal(gc.gather_columns(x, perm), x[:, perm.long()])


def test_what_it_cannot_take_is_refused():
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="gather_columns"):
        gc.gather_columns(x, torch.arange(32, device=DEVICE))
    with pytest.raises(ValueError, match="unit stride"):
        gc.gather_columns(x.t(), torch.arange(2, device=DEVICE))
