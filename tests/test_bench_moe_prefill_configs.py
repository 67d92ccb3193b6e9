"""h200_moe_prefill.py --write-configs: the shipped tile files of the device, with the fastest pair's (epilogue or
sorted) w13 / w2 tiles at exactly the token counts where it beat the shipped path (the files an engine A/B then reads
through KEEL_MOE_TILE_CONFIG_DIR); and the script's interpreted smoke run, sorted pair included."""

from __future__ import annotations

import os
import subprocess
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
               {"tokens": 4096},  # no pair measured: left alone
               {"tokens": 8192, "pair_ms": {"shipped": 2.3, "epilogue": 1.96, "sorted": 1.7},
                "epilogue_pair_tiles": {"w13": W13, "w2": W2},
                "sorted_pair_tiles": {"w13": {**W13, "SORTED_A": True}, "w2": {**W2, "SORTED_A": True}}}]
    changed = mp.write_configs(results, shape, "NVIDIA H200", tmp_path)
    names = {which: tc.config_file_name(mp.E, n, k, "NVIDIA H200")
             for which, n, k in (("w13", 2 * mp.INTER, mp.H), ("w2", mp.H, mp.INTER))}
    assert changed == {names["w13"]: [1024, 8192], names["w2"]: [1024, 8192]}
    for which, tile in (("w13", W13), ("w2", W2)):
        shipped = tc.read_tile_config_file(tc.CONFIG_DIR / names[which])
        written = tc.read_tile_config_file(tmp_path / names[which])
        assert written[1024] == tc.MoETileConfig.from_json(tile)
        assert written[8192] == tc.MoETileConfig.from_json({**tile, "SORTED_A": True})
        assert ({m: c for m, c in written.items() if m not in (1024, 8192)}
                == {m: c for m, c in shipped.items() if m not in (1024, 8192)})


def test_smoke_run_times_the_sorted_pair(tmp_path):
    """--smoke: the whole script interpreted on tiny shapes, the sorted pair's rows included."""
    import json

    out = tmp_path / "moe-prefill.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "h200_moe_prefill.py"
    subprocess.run([sys.executable, str(script), "--smoke", "--out", str(out)], check=True, timeout=600,
                   env={**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}, capture_output=True)
    row = json.loads(out.read_text())["results"][0]
    assert set(row["pair_ms"]) == {"shipped", "epilogue", "sorted"}
    assert {r["gathered"] for r in row["w13_sorted_c"]} == {False, True}
    assert row["w2_sorted_a"] and all("ms" in r for r in row["w2_sorted_a"] + row["w13_sorted_c"])
