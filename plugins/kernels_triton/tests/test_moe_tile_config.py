"""Tile configs of the fused MoE GEMM: tuned-file lookup (nearest token count), fallback heuristic, the
shipped files and their packaging."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch
from keel_kernels_triton.fused_moe import tile_config as tc
from keel_kernels_triton.fused_moe.tile_config import (
    MoETileConfig,
    MoETileConfigError,
    config_file_name,
    default_moe_tile_config,
    get_moe_tile_config,
    get_moe_tile_configs,
    pick_for_tokens,
    read_tile_config_file,
    write_tile_config_file,
)

CUDA = torch.device("cuda", 0)


@pytest.fixture
def fake_h200(monkeypatch, tmp_path):
    """Lookups see a CUDA device named like an H200 and a private config folder."""
    monkeypatch.setattr(tc, "_device_name", lambda device: "NVIDIA H200" if device.type == "cuda" else None)
    monkeypatch.setenv(tc.CONFIG_DIR_ENV, str(tmp_path))
    tc.clear_tile_config_cache()
    yield tmp_path
    tc.clear_tile_config_cache()


def test_file_name_matches_vllm_style():
    assert config_file_name(64, 2816, 2048, "NVIDIA H200") == "E=64,N=2816,K=2048,device_name=NVIDIA_H200.json"


def test_pick_nearest_key_at_or_above_else_largest():
    cfgs = {m: MoETileConfig(16, 32 << i, 64) for i, m in enumerate((1, 8, 64, 512))}
    assert pick_for_tokens(cfgs, 1) is cfgs[1]
    assert pick_for_tokens(cfgs, 2) is cfgs[8]
    assert pick_for_tokens(cfgs, 8) is cfgs[8]
    assert pick_for_tokens(cfgs, 65) is cfgs[512]
    assert pick_for_tokens(cfgs, 4096) is cfgs[512]


def test_tuned_file_is_used_for_its_device_and_shape(fake_h200):
    tuned = {1: MoETileConfig(16, 32, 256, 4, 5), 64: MoETileConfig(32, 64, 128, 8, 3)}
    write_tile_config_file(fake_h200 / config_file_name(64, 2816, 2048, "NVIDIA H200"), tuned)
    assert get_moe_tile_config(1, 64, 2816, 2048, 6, torch.bfloat16, CUDA, False) == tuned[1]
    assert get_moe_tile_config(7, 64, 2816, 2048, 6, torch.float16, CUDA, False) == tuned[64]
    assert get_moe_tile_config(9999, 64, 2816, 2048, 6, torch.bfloat16, CUDA, False) == tuned[64]
    # another shape, float32, the interpreter, or a CPU device: no file applies
    for args in ((1, 64, 4096, 1000, 6, torch.bfloat16, CUDA, False), (1, 64, 2816, 2048, 6, torch.float32, CUDA, False),
                 (1, 64, 2816, 2048, 6, torch.bfloat16, CUDA, True),
                 (1, 64, 2816, 2048, 6, torch.bfloat16, torch.device("cpu"), False)):
        assert get_moe_tile_config(*args) == default_moe_tile_config(*args[:6], interpret=args[7])


def test_sibling_device_file_serves_a_device_without_one(fake_h200, monkeypatch, caplog):
    """A device without a file borrows its sibling's tiles (same SM), and says so; its own file wins; a device
    with no sibling gets the heuristic. Fake names: the shipped folder already holds H100 and H200 files."""
    assert tc.SIBLING_DEVICES["NVIDIA H100 80GB HBM3"] == ("NVIDIA H200",)
    monkeypatch.setattr(tc, "SIBLING_DEVICES", {"Fake GPU B": ("Fake GPU A",)})
    tuned = {1: MoETileConfig(16, 32, 256, 4, 5)}
    own = {1: MoETileConfig(16, 64, 128, 4, 3)}
    write_tile_config_file(fake_h200 / config_file_name(64, 2816, 2048, "Fake GPU A"), tuned)
    monkeypatch.setattr(tc, "_device_name", lambda device: "Fake GPU B")
    with caplog.at_level("INFO", logger=tc.logger.name):
        assert get_moe_tile_config(1, 64, 2816, 2048, 6, torch.bfloat16, CUDA, False) == tuned[1]
    assert "using the Fake GPU A file" in caplog.text
    write_tile_config_file(fake_h200 / config_file_name(64, 2816, 2048, "Fake GPU B"), own)
    tc.clear_tile_config_cache()
    assert get_moe_tile_config(1, 64, 2816, 2048, 6, torch.bfloat16, CUDA, False) == own[1]
    monkeypatch.setattr(tc, "_device_name", lambda device: "Fake GPU C")
    tc.clear_tile_config_cache()
    assert get_moe_tile_config(1, 64, 2816, 2048, 6, torch.bfloat16, CUDA, False) == default_moe_tile_config(
        1, 64, 2816, 2048, 6, torch.bfloat16)


def test_missing_file_falls_back_to_heuristic(fake_h200):
    small = get_moe_tile_config(1, 64, 3072, 2048, 6, torch.bfloat16, CUDA, False)
    assert small == default_moe_tile_config(1, 64, 3072, 2048, 6, torch.bfloat16)
    # memory-bound decode: short M tiles, deeper K than the interpreter's 32, several stages
    assert small.block_m == 16 and small.block_k >= 128 and small.num_stages >= 3
    big = get_moe_tile_config(2048, 64, 3072, 2048, 6, torch.bfloat16, CUDA, False)
    assert big.block_m == 64 and big.block_n >= small.block_n
    # interpreted: today's small tiles, whatever the size
    assert get_moe_tile_config(2048, 64, 2816, 2048, 6, torch.bfloat16, CUDA, True) == MoETileConfig(16, 64, 32, 4, 1)
    assert get_moe_tile_config(3, 4, 40, 24, 2, torch.float32, torch.device("cpu"), True).block_n == 32


def test_interpret_default_follows_env(fake_h200, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_moe_tile_config(512, 64, 2816, 2048, 6, torch.bfloat16, CUDA).block_k == 32
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert get_moe_tile_config(512, 64, 2816, 2048, 6, torch.bfloat16, CUDA).block_k != 32


def test_pair_shares_block_m(fake_h200):
    write_tile_config_file(fake_h200 / config_file_name(64, 2816, 2048, "NVIDIA H200"), {8: MoETileConfig(32, 64, 128)})
    write_tile_config_file(fake_h200 / config_file_name(64, 2048, 1408, "NVIDIA H200"), {8: MoETileConfig(16, 32, 64)})
    c13, c2 = get_moe_tile_configs(4, (64, 2816, 2048), (64, 2048, 1408), 6, torch.bfloat16, CUDA, False)
    assert c13 == MoETileConfig(32, 64, 128) and c2 == MoETileConfig(32, 32, 64)


def test_bad_files_and_values_raise_typed_errors(fake_h200):
    path = fake_h200 / config_file_name(8, 64, 32, "NVIDIA H200")
    path.write_text(json.dumps({"1": {"BLOCK_SIZE_M": 16}}))
    with pytest.raises(MoETileConfigError, match="lacks"):
        get_moe_tile_config(1, 8, 64, 32, 2, torch.bfloat16, CUDA, False)
    path.write_text("{not json")
    with pytest.raises(MoETileConfigError, match=str(path.name)):
        read_tile_config_file(path)
    with pytest.raises(MoETileConfigError, match="power of two"):
        MoETileConfig(24, 64, 64)
    with pytest.raises(MoETileConfigError, match="at least 16"):
        MoETileConfig(8, 64, 64)


def test_write_read_round_trip(tmp_path):
    cfgs = {2: MoETileConfig(16, 64, 256, 4, 5), 1: MoETileConfig(16, 32, 128, 8, 4),
            4096: MoETileConfig(128, 128, 64, 8, 3, group_m=8)}
    write_tile_config_file(tmp_path / "x.json", cfgs)
    assert read_tile_config_file(tmp_path / "x.json") == cfgs
    body = json.loads((tmp_path / "x.json").read_text())
    assert list(body) == ["1", "2", "4096"]  # sorted by token count
    assert body["4096"]["GROUP_SIZE_M"] == 8 and "GROUP_SIZE_M" not in body["1"]  # vLLM's key; absent = 1
    with pytest.raises(MoETileConfigError, match="group_m"):
        MoETileConfig(16, 64, 64, group_m=0)


def test_fused_act_key_round_trips_and_is_checked(tmp_path):
    cfgs = {8192: MoETileConfig(128, 128, 64, 4, 3, group_m=8, fused_act=False), 1: MoETileConfig(16, 32, 128)}
    write_tile_config_file(tmp_path / "x.json", cfgs)
    assert read_tile_config_file(tmp_path / "x.json") == cfgs
    body = json.loads((tmp_path / "x.json").read_text())
    assert body["8192"]["FUSED_ACT"] is False and "FUSED_ACT" not in body["1"]  # absent = fused
    with pytest.raises(MoETileConfigError, match="fused_act"):
        MoETileConfig(16, 64, 64, fused_act=0)


def test_shipped_files_are_valid_and_packaged():
    for path in sorted(tc.CONFIG_DIR.glob("*.json")):
        assert path.name.startswith("E=") and ",device_name=" in path.name
        assert read_tile_config_file(path)
    # a non-editable install ships the folder: the plugin's package data names it
    plugin = Path(__file__).resolve().parents[1]
    data = tomllib.loads((plugin / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "configs/*.json" in data["keel_kernels_triton.fused_moe"]
    assert (tc.CONFIG_DIR / "README.md").is_file()


@pytest.mark.parametrize("path", sorted(tc.CONFIG_DIR.glob("*.json")), ids=lambda p: p.name)
def test_the_startup_warm_up_meets_every_shipped_entry(path):
    """A step takes the entry of the least key at or above its token count, each entry a compile: every entry
    a step of up to max_num_batched_tokens can take must be taken at one of the warm-up's prefill sizes, or it
    compiles under load in the first big batch (a key between the warm-up's powers of two would)."""
    from keel.testing.warm_up import assert_warm_up_meets

    configs = read_tile_config_file(path)
    for max_tokens in (2048, 8192, 16384):
        assert_warm_up_meets(lambda t: id(pick_for_tokens(configs, t)), max_tokens, path.name)
