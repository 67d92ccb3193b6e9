"""Inputs on which a hand-written e4m3 (float8_e4m3fn) rounding most easily disagrees with torch's cast, shared
by the plugins whose kernels round to e4m3 themselves (fp8 activations, the fp8 KV cache write).

Every point of the e4m3 grid, every midpoint between neighbours (ties: round to the even mantissa, including
the ones that round up into the next binade, 15.5 -> 16, 248 -> 256, and across the subnormal / normal
boundary) and the float32 neighbours either side of each midpoint; values that saturate (448 < |x|, up to
float32's max and infinity), float32 subnormals, signed zeros, and NaN (x86's and CUDA's canonical one). Float32,
both signs.
"""

from __future__ import annotations

import torch


def e4m3_edge_values(nan: bool = True) -> torch.Tensor:  # float32 [n]
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, ascending
    mid = (grid[:-1] + grid[1:]) / 2  # exact in float32
    inf = torch.full_like(mid, float("inf"))
    near = torch.cat((torch.nextafter(mid, -inf), mid, torch.nextafter(mid, inf)))
    big = torch.tensor([449.0, 464.0, 479.0, 480.0, 512.0, 1e4, 1e30, torch.finfo(torch.float32).max,
                        float("inf")])
    tiny = torch.tensor([1e-45, 1e-40, 2.0**-126, 2.0**-12, 2.0**-6 - 2.0**-24])
    pos = torch.cat((grid, near, big, tiny))
    out = torch.cat((pos, -pos))
    if nan:
        # the quiet NaN x86 makes, and CUDA's canonical one (0x7FFFFFFF, all payload bits set: a rounding that adds
        # to the bits overflows on it), both signs
        canonical = torch.tensor([0x7FFFFFFF, -1], dtype=torch.int32).view(torch.float32)
        out = torch.cat((out, torch.tensor([float("nan"), -float("nan")]), canonical))
    return out


def assert_same_e4m3_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    """Two float8_e4m3fn (or uint8) tensors bit-equal, except that a NaN's sign is not compared: it is whatever
    the device's division gives (x86 keeps the input's, CUDA returns a canonical NaN)."""
    got, want = got.cpu().view(torch.uint8).flatten(), want.cpu().view(torch.uint8).flatten()
    nan = (want & 0x7F) == 0x7F
    got, want = torch.where(nan, got & 0x7F, got), torch.where(nan, want & 0x7F, want)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} bytes differ, first (index, got, want): " + str(
        [(int(i), int(got[i]), int(want[i])) for i in bad[:8]])
