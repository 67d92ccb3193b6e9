"""Tile sizes of the fused MoE grouped GEMM: tuned per device and GEMM shape, or a heuristic.

`fused_experts_triton` (grouped_gemm.py) asks `get_moe_tile_configs` once per call (the answer is cached, so a decode step
pays a dict lookup per layer). Tuned tiles live in JSON files named like vLLM's,

    configs/E={num_experts},N={n},K={k},device_name={torch.cuda.get_device_name() with spaces as _}.json

one file per GEMM shape (the w13 GEMM has N = 2 * intermediate, K = hidden; the w2 GEMM N = hidden,
K = intermediate), mapping a token count to a config:

    {"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "num_warps": 4, "num_stages": 4}, ...}

A step of M tokens uses the entry with the smallest key >= M, else the largest key. The folder named by
KEEL_MOE_TILE_CONFIG_DIR is searched before the package's own `configs/` (which
`benchmarks/h200_moe_tiles.py` writes); a device without a file of its own borrows the file of a sibling
with the same SM (`SIBLING_DEVICES`: H100 SXM and H200), and logs it. Files describe 16-bit activations;
float32 and interpreted runs always use the built-in tiles. The choice depends on the token count only,
never on the routing, so a step captured in a CUDA graph replays with the launch shapes it was captured with.

The path is part of the config: `split_k` (JSON "SPLIT_K") > 1 selects the small-M path of the grouped
GEMM (grouped_gemm.py: K split over programs, float32 partials summed by the consumer). An entry without
"SPLIT_K" leaves it to the small-M rule (`default_split_k`: steps of at most SMALL_M_MAX_TOKENS tokens
split K; larger ones do not), so files tuned before the path existed get it at decode sizes, and a file
can switch it off per token count with "SPLIT_K": 1.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from keel_kernels_triton.support import interpreter_enabled

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
CONFIG_DIR_ENV = "KEEL_MOE_TILE_CONFIG_DIR"
_JSON_KEYS = {"block_m": "BLOCK_SIZE_M", "block_n": "BLOCK_SIZE_N", "block_k": "BLOCK_SIZE_K",
              "num_warps": "num_warps", "num_stages": "num_stages"}
_SPLIT_KEY = "SPLIT_K"  # optional: absent means the small-M rule decides
_GROUP_KEY = "GROUP_SIZE_M"  # optional (vLLM's key): absent means 1, M-blocks fastest over a 2-D grid
_FUSED_ACT_KEY = "FUSED_ACT"  # optional, w2 files: false runs silu_and_mul as its own kernel first
_KERNEL_KEY = "KERNEL"  # optional: the main loop's form, one of KERNELS; absent means "dot"
_WEIGHT_TMA_KEY = "WEIGHT_TMA"  # optional: true loads weight tiles through a Hopper TMA descriptor
_ACT_EPILOGUE_KEY = "ACT_EPILOGUE"  # optional, w13 files: true stores silu(gate) * up from the w13 GEMM
# "dot": tensor-core tiles (BLOCK_M >= 16); "gemv": rows times weight tiles summed over K on CUDA cores,
# for 1-2 rows per expert, where BLOCK_M 1-8 pads no rows and many short-N programs stream the weights.
KERNELS = ("dot", "gemv")
# Steps of at most this many tokens take the small-M (split-K) path unless a tuned entry says otherwise:
# at top-6 of 64 experts a 16-token step still leaves most experts with one or two rows.
SMALL_M_MAX_TOKENS = 16


class MoETileConfigError(ValueError):
    """A tile config file or value is malformed (names the file and the offending entry)."""


@dataclass(frozen=True)
class MoETileConfig:
    """Launch parameters of one `_fused_moe_kernel` launch. `block_m` is also the padding unit of
    `moe_align_block_size`, so both GEMMs of one MoE call share it. `split_k` > 1: the small-M path with
    that many K slices; None (read from a file entry without "SPLIT_K"): resolved by the lookup.
    `group_m` > 1: programs walk groups of that many M-blocks across every N-block before the next group
    (the activation rows and the expert's weight tiles of a group stay in L2 at prefill sizes, where a
    grid with M-blocks fastest reads the activations once per N-block). `fused_act` (w2 GEMMs): False runs
    the gated activation as its own kernel first -- at prefill sizes the A-load activation recomputes
    silu once per N-block and halves the main loop's rate (H200, DSV2-Lite, 8192 tokens: 1.80 ms fused vs
    0.69 + 0.18 ms, `benchmarks/h200_moe_prefill.py`). `kernel` "gemv" (KERNELS) runs the main loop without
    tensor cores, so `block_m` may be 1-16 (decode: one or two rows per expert). `weight_tma`: weight tiles
    come through a TMA descriptor (Hopper and newer; block_n and block_k of at most 256). `act_epilogue`
    (w13 GEMMs, silu): each program computes a gate tile and its up tile and stores silu(gate) * up, so
    the down GEMM reads a plain activation (no silu recomputed per N-block, no separate kernel); one K
    slice only (`split_k` 1, or None: the lookup then resolves 1)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int | None = 1
    group_m: int = 1
    fused_act: bool = True
    kernel: str = "dot"
    weight_tma: bool = False
    act_epilogue: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise MoETileConfigError(f"{name} must be a positive power of two, got {v!r}")
        if self.kernel not in KERNELS:
            raise MoETileConfigError(f"kernel ({_KERNEL_KEY}) must be one of {KERNELS}, got {self.kernel!r}")
        if self.kernel == "dot" and (self.block_m < 16 or self.block_n < 16 or self.block_k < 16):
            raise MoETileConfigError(f"tl.dot needs tiles of at least 16, got {self}")
        if self.kernel == "gemv" and (self.block_m > 16 or self.block_n < 16 or self.block_k < 16):
            raise MoETileConfigError(f"gemv tiles take block_m <= 16 and block_n, block_k >= 16, got {self}")
        if not isinstance(self.weight_tma, bool) or (self.weight_tma and max(self.block_n, self.block_k) > 256):
            raise MoETileConfigError(f"weight_tma ({_WEIGHT_TMA_KEY}) must be a bool and TMA boxes at most 256 "
                                     f"wide, got {self}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise MoETileConfigError(f"num_stages must be a positive int, got {self.num_stages!r}")
        if self.split_k is not None and (not isinstance(self.split_k, int) or not 1 <= self.split_k <= 64):
            raise MoETileConfigError(f"split_k must be an int in 1..64, got {self.split_k!r}")
        if not isinstance(self.group_m, int) or not 1 <= self.group_m <= 64:
            raise MoETileConfigError(f"group_m must be an int in 1..64, got {self.group_m!r}")
        if not isinstance(self.fused_act, bool):
            raise MoETileConfigError(f"fused_act ({_FUSED_ACT_KEY}) must be true or false, got {self.fused_act!r}")
        if not isinstance(self.act_epilogue, bool) or (self.act_epilogue and self.split_k not in (None, 1)):
            raise MoETileConfigError(f"act_epilogue ({_ACT_EPILOGUE_KEY}) must be a bool and takes one K "
                                     f"slice (SPLIT_K 1), got {self}")

    def to_json(self) -> dict[str, int]:
        body = {key: getattr(self, field) for field, key in _JSON_KEYS.items()}
        if self.split_k is not None:
            body[_SPLIT_KEY] = self.split_k
        if self.group_m != 1:
            body[_GROUP_KEY] = self.group_m
        if not self.fused_act:
            body[_FUSED_ACT_KEY] = False
        if self.kernel != "dot":
            body[_KERNEL_KEY] = self.kernel
        if self.weight_tma:
            body[_WEIGHT_TMA_KEY] = True
        if self.act_epilogue:
            body[_ACT_EPILOGUE_KEY] = True
        return body

    @classmethod
    def from_json(cls, entry: dict) -> MoETileConfig:
        missing = [k for k in _JSON_KEYS.values() if k not in entry]
        if missing:
            raise MoETileConfigError(f"tile config {entry} lacks {missing}")
        optional = {_SPLIT_KEY, _GROUP_KEY, _FUSED_ACT_KEY, _KERNEL_KEY, _WEIGHT_TMA_KEY, _ACT_EPILOGUE_KEY}
        unknown = sorted(set(entry) - set(_JSON_KEYS.values()) - optional)
        if unknown:
            raise MoETileConfigError(f"tile config {entry} has unknown keys {unknown}")
        return cls(**{field: entry[key] for field, key in _JSON_KEYS.items()}, split_k=entry.get(_SPLIT_KEY),
                   group_m=entry.get(_GROUP_KEY, 1), fused_act=entry.get(_FUSED_ACT_KEY, True),
                   kernel=entry.get(_KERNEL_KEY, "dot"), weight_tma=entry.get(_WEIGHT_TMA_KEY, False),
                   act_epilogue=entry.get(_ACT_EPILOGUE_KEY, False))


def config_file_name(num_experts: int, n: int, k: int, device_name: str) -> str:
    """The file name tuned tiles for this GEMM shape on `device_name` are stored under."""
    return f"E={num_experts},N={n},K={k},device_name={device_name.replace(' ', '_')}.json"


def read_tile_config_file(path: Path) -> dict[int, MoETileConfig]:
    """token count -> config, from one JSON file (raises MoETileConfigError naming the file)."""
    try:
        raw = json.loads(Path(path).read_text())
        if not isinstance(raw, dict) or not raw:
            raise MoETileConfigError("expected a non-empty object of token count -> config")
        return {int(m): MoETileConfig.from_json(entry) for m, entry in raw.items()}
    except (OSError, ValueError, TypeError) as e:
        raise MoETileConfigError(f"bad MoE tile config file {path}: {e}") from e


def write_tile_config_file(path: Path, configs: dict[int, MoETileConfig]) -> None:
    """Store `configs` (token count -> config) in the format `read_tile_config_file` reads."""
    body = {str(m): configs[m].to_json() for m in sorted(configs)}
    Path(path).write_text(json.dumps(body, indent=2) + "\n")


def _search_dirs() -> list[Path]:
    extra = os.environ.get(CONFIG_DIR_ENV)
    return ([Path(extra)] if extra else []) + [CONFIG_DIR]


# Devices whose tuned tiles serve each other when one has no file: the same SM (sm_90, 132 SMs, 228 KB of
# shared memory per SM), so the same tiles fit and occupy the same way; only the memory bandwidth differs
# (H100 SXM 3.35 TB/s, H200 4.8 TB/s), which moves where a memory-bound tile ends, not which tile fits.
# The device's own file always wins; the borrowed file is named in the log.
SIBLING_DEVICES: dict[str, tuple[str, ...]] = {
    "NVIDIA H100 80GB HBM3": ("NVIDIA H200",),
    "NVIDIA H200": ("NVIDIA H100 80GB HBM3",),
}


@functools.cache
def _tuned(num_experts: int, n: int, k: int, device_name: str, dirs: tuple[Path, ...]) -> dict[int, MoETileConfig]:
    found = _tuned_for_device(num_experts, n, k, device_name, dirs)
    if found:
        return found
    for sibling in SIBLING_DEVICES.get(device_name, ()):
        found = _tuned_for_device(num_experts, n, k, sibling, dirs)
        if found:
            logger.info("fused MoE tiles for %s (E=%d, N=%d, K=%d): no file of its own, using the %s file "
                        "(same SM, see SIBLING_DEVICES)", device_name, num_experts, n, k, sibling)
            return found
    return {}


def _tuned_for_device(num_experts: int, n: int, k: int, device_name: str,
                      dirs: tuple[Path, ...]) -> dict[int, MoETileConfig]:
    name = config_file_name(num_experts, n, k, device_name)
    for d in dirs:
        if (d / name).is_file():
            return read_tile_config_file(d / name)
    # No file for this expert count (e.g. shared experts fused into the routed GEMM as extra experts): the
    # same GEMM shape tuned for the nearest expert count -- tiles depend on rows per expert and N, K.
    # Ties go to the earlier search directory (KEEL_MOE_TILE_CONFIG_DIR before the shipped files), then to
    # the smaller expert count -- never to the path's spelling.
    near = []
    for rank, d in enumerate(dirs):
        for path in d.glob(config_file_name(0, n, k, device_name).replace("E=0,", "E=*,", 1)):
            e = path.name.split(",", 1)[0].removeprefix("E=")
            if e.isdigit():
                near.append((abs(int(e) - num_experts), rank, int(e), str(path)))
    return read_tile_config_file(Path(min(near)[3])) if near else {}


def pick_for_tokens(configs: dict[int, MoETileConfig], num_tokens: int) -> MoETileConfig:
    """The entry with the smallest key >= num_tokens, else the one with the largest key."""
    above = [m for m in configs if m >= num_tokens]
    return configs[min(above) if above else max(configs)]


def default_split_k(num_tokens: int, k: int, dtype: torch.dtype, interpret: bool = False) -> int:
    """The small-M rule: K slices for a step of `num_tokens` tokens over a reduction of size `k`.

    At decode sizes only the few routed experts' weights are read, by (live blocks x N tiles) programs --
    a couple of waves on an H200's 132 SMs, with a long serial K loop each. Splitting K multiplies the
    programs (more loads in flight, shorter tails) for a float32 partial per slice, which is tiny next to
    the weights. Interpreted and float32 runs keep one slice (tests pick the path explicitly)."""
    if interpret or dtype.itemsize > 2 or num_tokens > SMALL_M_MAX_TOKENS:
        return 1
    return 4 if k >= 1024 else 2 if k >= 512 else 1


def default_moe_tile_config(
    num_tokens: int, num_experts: int, n: int, k: int, top_k: int, dtype: torch.dtype, interpret: bool = False
) -> MoETileConfig:
    """Built-in tiles. Interpreted: small tiles (every program runs in Python). Compiled: at decode sizes
    (few rows per expert) the GEMM streams expert weights, so short M tiles, deep K tiles and several
    stages keep many loads in flight (and K splits, `default_split_k`); larger steps grow M and N tiles to
    reuse each weight tile."""
    split = default_split_k(num_tokens, k, dtype, interpret)
    if interpret:
        return MoETileConfig(16, 64 if n >= 64 else 32, 32, 4, 1)
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    wide = dtype.itemsize <= 2  # float32 tiles take twice the shared memory
    if rows_per_expert <= 16:
        return MoETileConfig(16, 64, 128 if wide else 64, 4, 4 if wide else 3, split)
    if rows_per_expert <= 64:
        return MoETileConfig(32, 64, 128 if wide else 64, 4, 3, split)
    return MoETileConfig(64, 128 if wide else 64, 64, 8, 3 if wide else 2, split)


def _device_name(device: torch.device) -> str | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


def get_moe_tile_config(
    num_tokens: int,
    num_experts: int,
    n: int,
    k: int,
    top_k: int,
    dtype: torch.dtype,
    device: torch.device,
    interpret: bool | None = None,
) -> MoETileConfig:
    """Tiles for one grouped GEMM with weights [num_experts, n, k] over num_tokens * top_k rows: the tuned
    file's entry for this device and shape if there is one (16-bit dtypes, compiled), else the default.
    `interpret` defaults to whether TRITON_INTERPRET is set."""
    if interpret is None:
        interpret = interpreter_enabled()
    return _lookup(num_tokens, num_experts, n, k, top_k, dtype, torch.device(device), interpret)


@functools.cache
def _lookup(
    num_tokens: int, num_experts: int, n: int, k: int, top_k: int, dtype: torch.dtype, device: torch.device,
    interpret: bool,
) -> MoETileConfig:
    name = None if interpret or dtype.itemsize > 2 else _device_name(device)
    if name is not None:
        tuned = _tuned(num_experts, n, k, name, tuple(_search_dirs()))
        if tuned:
            cfg = pick_for_tokens(tuned, num_tokens)
            if cfg.split_k is None:
                split = 1 if cfg.act_epilogue else default_split_k(num_tokens, k, dtype, interpret)
                cfg = dataclasses.replace(cfg, split_k=split)
            return cfg
    return default_moe_tile_config(num_tokens, num_experts, n, k, top_k, dtype, interpret)


def get_moe_tile_configs(
    num_tokens: int,
    w13_shape: tuple[int, int, int],  # [E, 2 * intermediate, hidden]
    w2_shape: tuple[int, int, int],  # [E, hidden, intermediate]
    top_k: int,
    dtype: torch.dtype,
    device: torch.device,
    interpret: bool | None = None,
) -> tuple[MoETileConfig, MoETileConfig]:
    """(w13 GEMM tiles, w2 GEMM tiles) for one MoE call; the w2 tiles take the w13 block_m (the sorted rows
    are padded once, to that block_m; the sweep writes both files with equal block_m per token count)."""
    e, n13, k13 = w13_shape
    c13 = get_moe_tile_config(num_tokens, e, n13, k13, top_k, dtype, device, interpret)
    c2 = get_moe_tile_config(num_tokens, e, w2_shape[1], w2_shape[2], top_k, dtype, device, interpret)
    if c2.block_m != c13.block_m:  # below 16 rows only the gemv loop runs
        c2 = dataclasses.replace(c2, block_m=c13.block_m, kernel="gemv" if c13.block_m < 16 else c2.kernel)
    return c13, c2


def clear_tile_config_cache() -> None:
    """Forget looked-up files and answers (tests; a process that wrote new files)."""
    _tuned.cache_clear()
    _lookup.cache_clear()
