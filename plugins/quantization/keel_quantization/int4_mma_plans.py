"""Where the mid-size int4 GEMM (`int4_mma_triton`) serves a step, per device, as measured -- nothing else.

`int4_linear` asks `mma_tile(m, n, k, device_name, dtype_name)` for a CUDA step of M tokens on a layer of N
outputs and K inputs whose scale groups the kernel takes (in order, whole K tiles); a tile means that kernel,
None the paths it had (the tile GEMM below `DEQUANT_GEMM_MIN_M`, dequantize + cuBLAS from it). The answer comes
from `int4_mma_configs/<device>.json` (or the folder named by KEEL_INT4_MMA_CONFIG_DIR, read first), written by
`benchmarks/h200_int4_mma.py` with the M and layer shapes it measured and, where the kernel beat the path a
null entry keeps by 3% or more, the tile that did:

    {"bfloat16": [{"m": 128, "n": 6144, "k": 4096, "tile": {"block_n": 64, "block_m": 128, ...}},
                  {"m": 256, "n": 6144, "k": 4096, "tile": null}, {"m": 512, "tile": null}, ...]}

Entries naming a layer's (n, k) serve that shape; a shape no entry names takes the entries that name none
(shape-free rows, e.g. a four-layer total's). Among those, a step of M tokens takes the entry of the least
measured M at or above it (M is fixed per CUDA-graph bucket, so the choice is too); below the first measured
M (decode sizes, the GEMV's and the tile GEMM's: the sweep does not measure them), past the last, or for a
device without a file, the other paths. No file is committed until a device run has measured the kernel
faster. Pure Python: the CPU never imports Triton for this.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "int4_mma_configs"
CONFIG_DIR_ENV = "KEEL_INT4_MMA_CONFIG_DIR"


@dataclass(frozen=True)
class MmaTile:
    block_n: int = 128  # weight rows a program (the MMA's M: 64 per warpgroup)
    block_m: int = 128  # tokens a program (the MMA's N)
    block_k: int = 128  # inputs a tile: BLOCK_K / 8 >= 16 word rows, dividing the scale group
    num_warps: int = 8
    num_stages: int = 3
    split_k: int = 1  # K split across programs (float32 partials, summed in order by a second launch): more
    # programs where N / block_n x M / block_m leaves SMs idle or alone (Llama-8B's o / down at 128-256 tokens)
    pairs: bool = False  # the 16-bit dequantize makes neighbouring inputs one register (the same numbers;
    # sm_90 SASS: 12-15% fewer instructions a K tile from 32 tokens, more at 16)

    def __post_init__(self) -> None:
        pow2 = lambda v: v > 0 and not v & (v - 1)  # noqa: E731
        if not (pow2(self.block_n) and self.block_n >= 16 and pow2(self.block_m) and self.block_m >= 16
                and pow2(self.block_k) and self.block_k >= 128 and self.num_warps in (4, 8) and self.num_stages >= 1
                and self.split_k >= 1 and isinstance(self.pairs, bool)):
            raise ValueError(f"int4 mma tile: blocks must be powers of two (N, M >= 16; K >= 128), num_warps 4 or 8, "
                             f"num_stages >= 1, split_k >= 1, pairs a bool: {self}")


def misfit(k: int, group_size: int, tile: MmaTile) -> str | None:
    """Why a layer of K inputs with scale groups of `group_size` (in order; 0: gathered) cannot take this GEMM
    with `tile` (None: it can)."""
    if k % tile.block_k:
        return f"K {k} is not a multiple of BLOCK_K {tile.block_k}"
    group = min(group_size, k)
    if group <= 0 or group % tile.block_k:
        return (f"scale groups of {group_size} inputs" + (" (gathered)" if group_size <= 0 else "")
                + f" do not hold whole K tiles of {tile.block_k}")
    return None


def device_file_name(device_name: str) -> str:
    return device_name.replace(" ", "_") + ".json"


Shape = tuple[int, int] | None  # (n, k) a row was measured at; None: any shape


@functools.cache
def load_plans(device_name: str, dtype_name: str) -> dict[Shape, tuple[tuple[int, MmaTile | None], ...]]:
    """{(n, k) or None: ((measured M, tile or None), ...) ascending} for activations of `dtype_name` on this
    device (empty without a file)."""
    for folder in (os.environ.get(CONFIG_DIR_ENV), CONFIG_DIR):
        if not folder:
            continue
        path = Path(folder) / device_file_name(device_name)
        if path.exists():
            plans: dict[Shape, list] = {}
            for r in json.loads(path.read_text()).get(dtype_name, []):
                shape = (int(r["n"]), int(r["k"])) if "n" in r or "k" in r else None
                plans.setdefault(shape, []).append((int(r["m"]), MmaTile(**r["tile"]) if r.get("tile") else None))
            logger.info("int4 mma: %d measured (shape, step size) entries for %s %s (%s)",
                        sum(map(len, plans.values())), device_name, dtype_name, path)
            return {shape: tuple(sorted(rows, key=lambda r: r[0])) for shape, rows in plans.items()}
    return {}


def mma_tile(m: int, n: int, k: int, device_name: str, dtype_name: str) -> MmaTile | None:
    """The tile a step of `m` tokens on a layer of `n` outputs x `k` inputs runs the mid-size int4 GEMM with on
    this device, or None."""
    by_shape = load_plans(device_name, dtype_name)
    plans = by_shape.get((n, k), by_shape.get(None, ()))
    if not plans or m < plans[0][0]:  # a size below the sweep's: it says nothing there
        return None
    for measured_m, tile in plans:
        if m <= measured_m:
            return tile
    return None
