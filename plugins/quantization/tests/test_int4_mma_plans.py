"""Where the mid-size int4 GEMM serves, per device, as measured (`int4_mma_plans`; no Triton): a plan file's
entries by step size (the least measured M at or above a step's), null entries, steps below the first and
past the last keep the other paths, a device without a file has none; `Int4LinearMethod.mma_tile` also keeps them for layers
the kernel does not take (gathered or small groups, float32); tiles are validated; the benchmark writes a
tile only where it beat today's paths."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from keel_quantization import int4_mma_plans as P
from keel_quantization.int4_linear import Int4Format, Int4LinearMethod

from keel.testing.scripts import load_script

TILE = P.MmaTile(128, 64, 128, 8, 4)


@pytest.fixture
def plan_dir(tmp_path, monkeypatch):
    rows = [{"m": 64, "tile": dataclasses.asdict(TILE)}, {"m": 128, "tile": dataclasses.asdict(TILE)}, {"m": 256, "tile": None},
            {"m": 512, "tile": dataclasses.asdict(P.MmaTile())}]
    (tmp_path / P.device_file_name("Fake GPU 80GB")).write_text(json.dumps({"bfloat16": rows}))
    monkeypatch.setenv(P.CONFIG_DIR_ENV, str(tmp_path))
    P.load_plans.cache_clear()
    yield tmp_path
    P.load_plans.cache_clear()


def test_a_step_takes_the_least_measured_size_at_or_above_it(plan_dir):
    assert (plan_dir / "Fake_GPU_80GB.json").exists()
    assert P.mma_tile(64, 4096, 4096, "Fake GPU 80GB", "bfloat16") == TILE
    assert P.mma_tile(128, 4096, 4096, "Fake GPU 80GB", "bfloat16") == TILE
    assert P.mma_tile(65, 4096, 4096, "Fake GPU 80GB", "bfloat16") == TILE
    assert P.mma_tile(1, 4096, 4096, "Fake GPU 80GB", "bfloat16") is None  # decode: below the first M
    assert P.mma_tile(63, 4096, 4096, "Fake GPU 80GB", "bfloat16") is None
    assert P.mma_tile(129, 4096, 4096, "Fake GPU 80GB", "bfloat16") is None  # 256: no win, the other paths
    assert P.mma_tile(300, 4096, 4096, "Fake GPU 80GB", "bfloat16") == P.MmaTile()
    assert P.mma_tile(513, 4096, 4096, "Fake GPU 80GB", "bfloat16") is None  # past the last measured size
    assert P.mma_tile(64, 4096, 4096, "Fake GPU 80GB", "float16") is None  # measured for bf16 only
    assert P.mma_tile(64, 4096, 4096, "Other GPU", "bfloat16") is None  # no file for that device


def test_shipped_plan_files_are_valid_and_named_in_the_readme():
    readme = (P.CONFIG_DIR / "README.md").read_text()
    for path in P.CONFIG_DIR.glob("*.json"):  # none yet: each comes with the run that measured it
        assert f"`{path.name}`" in readme, path.name
        for dtype, rows in json.loads(path.read_text()).items():
            assert dtype in ("bfloat16", "float16") and rows
            assert all(int(r["m"]) > 0 and (r["tile"] is None or P.MmaTile(**r["tile"])) for r in rows)


def test_the_linear_method_keeps_its_paths_where_the_kernel_does_not_fit(plan_dir):
    method = Int4LinearMethod(Int4Format("gptq", 128))
    method.group_in_order = 128
    assert method.mma_tile(100, 4096, 4096, torch.bfloat16, "Fake GPU 80GB") == TILE
    assert method.mma_tile(100, 4096, 4096, torch.float32, "Fake GPU 80GB") is None
    assert method.mma_tile(100, 4096, 4000, torch.bfloat16, "Fake GPU 80GB") is None  # K off the 128 grid
    method.group_in_order = 64  # groups smaller than the K tile
    assert method.mma_tile(100, 4096, 4096, torch.bfloat16, "Fake GPU 80GB") is None
    method.group_in_order = 0  # desc_act: gathered groups
    assert method.mma_tile(100, 4096, 4096, torch.bfloat16, "Fake GPU 80GB") is None


def test_tiles_are_validated():
    for bad in ({"block_k": 64}, {"block_n": 48}, {"block_m": 8}, {"num_warps": 2}, {"num_stages": 0}):
        with pytest.raises(ValueError, match="int4 mma tile"):
            P.MmaTile(**bad)
    assert "gathered" in P.misfit(4096, 0, TILE) and P.misfit(4096, -1, TILE) and P.misfit(4096, 4096, TILE) is None


def test_the_benchmark_writes_a_tile_only_where_it_beat_the_path_it_replaces():
    bench = load_script(Path(__file__).resolve().parents[3] / "benchmarks" / "h200_int4_mma.py")
    tiles = dict(bench._tiles(P.MmaTile))
    label = next(iter(tiles))
    rows = [  # below 256 a null entry keeps the tile GEMM, from it dequantize + cuBLAS
        {"m": 128, "n": 4096, "k": 4096, "us": {"dequant_cublas": 400.0, "shipped_tile_gemm": 500.0, label: 480.0}},
        {"m": 256, "n": 4096, "k": 4096, "us": {"dequant_cublas": 700.0, "shipped_tile_gemm": 600.0, label: 690.0}},
        {"m": 128, "n": 1024, "k": 4096, "us": {"dequant_cublas": 400.0, "shipped_tile_gemm": 490.0, label: 480.0}},
    ]
    assert bench.plan_rows(rows, tiles, 256) == [
        {"m": 128, "n": 1024, "k": 4096, "tile": None},  # not 3% under the tile GEMM's 490
        {"m": 128, "n": 4096, "k": 4096, "tile": dataclasses.asdict(tiles[label])},  # under 0.97 x 500
        {"m": 256, "n": 4096, "k": 4096, "tile": None}]  # not 3% under dequantize + cuBLAS's 700


def test_entries_naming_a_shape_serve_it_and_shape_free_ones_the_rest(tmp_path, monkeypatch):
    other = P.MmaTile(64, 128, 128, 4, 3)
    rows = [{"m": 64, "tile": dataclasses.asdict(TILE)}, {"m": 256, "tile": dataclasses.asdict(TILE)},
            {"m": 128, "n": 6144, "k": 4096, "tile": dataclasses.asdict(other)},
            {"m": 256, "n": 6144, "k": 4096, "tile": None}]
    (tmp_path / P.device_file_name("Fake GPU 80GB")).write_text(json.dumps({"bfloat16": rows}))
    monkeypatch.setenv(P.CONFIG_DIR_ENV, str(tmp_path))
    P.load_plans.cache_clear()
    try:
        assert P.mma_tile(128, 6144, 4096, "Fake GPU 80GB", "bfloat16") == other
        assert P.mma_tile(200, 6144, 4096, "Fake GPU 80GB", "bfloat16") is None  # its own null
        assert P.mma_tile(64, 6144, 4096, "Fake GPU 80GB", "bfloat16") is None  # below its shape's first M
        assert P.mma_tile(200, 4096, 4096, "Fake GPU 80GB", "bfloat16") == TILE  # no entry names it
        method = Int4LinearMethod(Int4Format("gptq", 128))
        method.group_in_order = 128
        assert method.mma_tile(128, 6144, 4096, torch.bfloat16, "Fake GPU 80GB") == other
    finally:
        P.load_plans.cache_clear()
