"""h200_moe_prefill.py --write-configs: the shipped tile files of the device, with the epilogue pair's w13 / w2 tiles
at exactly the token counts where the pair beat the shipped path (the files an engine A/B then reads through
KEEL_MOE_TILE_CONFIG_DIR)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import h200_moe_prefill as mp  # noqa: E402

tc = pytest.importorskip("keel_kernels_triton.fused_moe.tile_config")

W13 = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "num_warps": 8, "num_stages": 3, "SPLIT_K": 1,
       "GROUP_SIZE_M": 8, "ACT_EPILOGUE": True}
W2 = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "num_warps": 8, "num_stages": 3, "SPLIT_K": 1,
      "GROUP_SIZE_M": 8}


def test_write_configs_changes_only_the_sizes_the_pair_won(tmp_path):
    shape = {"e": mp.E, "h": mp.H, "inter": mp.INTER, "top_k": mp.TOP_K}
    results = [{"tokens": 1024, "pair_ms": {"shipped": 0.74, "epilogue": 0.54},
                "epilogue_pair_tiles": {"w13": W13, "w2": W2}},
               {"tokens": 2048, "pair_ms": {"shipped": 0.80, "epilogue": 0.83},
                "epilogue_pair_tiles": {"w13": W13, "w2": W2}},
               {"tokens": 4096}]  # no pair measured: left alone
    changed = mp.write_configs(results, shape, "NVIDIA H200", tmp_path)
    names = {which: tc.config_file_name(mp.E, n, k, "NVIDIA H200")
             for which, n, k in (("w13", 2 * mp.INTER, mp.H), ("w2", mp.H, mp.INTER))}
    assert changed == {names["w13"]: [1024], names["w2"]: [1024]}
    for which, tile in (("w13", W13), ("w2", W2)):
        shipped = tc.read_tile_config_file(tc.CONFIG_DIR / names[which])
        written = tc.read_tile_config_file(tmp_path / names[which])
        assert written[1024] == tc.MoETileConfig.from_json(tile)
        assert {m: c for m, c in written.items() if m != 1024} == {m: c for m, c in shipped.items() if m != 1024}
