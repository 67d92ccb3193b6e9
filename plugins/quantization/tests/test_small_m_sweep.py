"""The H200 sweep of the decode-size GEMM plans (benchmarks/h200_quant_small_m.py) cannot run here; its
grid can be checked: every candidate is a plan the launchers accept for its family (block scales and int4
groups of 128: K tiles inside a group), GEMV programs stay within their register budget, the compiles
(the sweep's main cost) stay bounded, the per-bucket choice sums over the layers, and a layer whose own
plan beats its bucket's by the margin gets it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from keel_quantization.small_m_plan import SmallMPlan

from keel.testing.scripts import load_script

SWEEP = Path(__file__).resolve().parents[3] / "benchmarks" / "h200_quant_small_m.py"


@pytest.fixture(scope="module")
def sweep():
    return load_script(SWEEP)


@pytest.mark.parametrize("family", ["fp8_row", "fp8_block", "int4_g128"])
def test_candidates_are_valid_plans_and_compiles_bounded(sweep, family):
    for m in sweep.MS:
        cands = sweep.candidates(family, m)
        assert cands["default"] is None and len(cands) >= 8
        for label, p in cands.items():
            if p is None:
                continue
            assert isinstance(p, SmallMPlan)
            if p.kernel == "gemv_fold":  # its K tiles may also hold whole groups (s / z per word row)
                assert family == "int4_g128" and m <= sweep.FOLD_MAX_M and p.block_m >= m, label
                assert 128 % p.block_k == 0 or p.block_k % 128 == 0, label
            elif family != "fp8_row":
                assert 128 % p.block_k == 0, label
            if p.kernel == "gemv":
                assert m <= sweep.GEMV_MAX_M and p.block_m >= m
                assert p.block_m * p.block_n * p.block_k <= sweep.GEMV_MAX_ELEMENTS
        kernels = {"dot", "gemv"} if m <= sweep.GEMV_MAX_M else {"dot"}
        if family == "int4_g128" and m <= sweep.FOLD_MAX_M:
            kernels.add("gemv_fold")
        assert {p.kernel for p in cands.values() if p} == kernels
    # int4 also sweeps gemv_fold's tiles, stage and K-tile variants: ~3-4 min of one device call
    # the pipelined fp8 GEMV candidates (M <= PIPE_MAX_M) add ~10-20 compiles a family
    assert sweep.compile_count(family) <= (85 if family == "int4_g128" else 45)


def test_best_per_bucket_sums_over_the_layers(sweep):
    a, b = "dot 16x32x256 s2", "gemv 1x16x256 s4"
    row = {"family": "fp8_row", "m": 1, "n": 4096}
    rows = [{**row, "layer": "o", "k": 4096, "floor_us": 1.0, "bf16_cublas_us": 3.0,
             "us": {"default": 4.0, a: 1.0, b: 3.0}},
            {**row, "layer": "down", "k": 14336, "floor_us": 2.0, "bf16_cublas_us": 5.0,
             "us": {"default": 5.0, a: 9.0, b: 3.0}},
            {**row, "layer": "x", "k": 512, "floor_us": 1.0, "bf16_cublas_us": 1.0, "us": {"default": 1.0, b: 1.0}}]
    best = sweep.best_per_bucket(rows)["fp8_row"]["1"]
    assert best["best"] == b and best["total_us"] == 7.0 and best["default_total_us"] == 10.0  # a not on all
    assert best["best_over_floor"] == 7.0 / 4.0
    assert best["plan"] == dataclasses.asdict(SmallMPlan("gemv", 1, 16, 256, 4))
    assert list(best["layers"]) == ["o"] and best["layers"]["o"]["best"] == a  # o's own best
    assert best["with_layers_total_us"] == 5.0


def test_a_sweeps_best_plans_become_the_tables(sweep):
    from keel_quantization import small_m_plan

    dot = SmallMPlan("dot", 16, 64, 128, 4)
    best = {"fp8_row": {"1": {"plan": None}, "16": {"plan": dataclasses.asdict(dot)}},
            "int4_g128": {"1": {"plan": dataclasses.asdict(SmallMPlan("gemv", 1, 32, 128, 2))}},
            "fp8_row_w8a8": {"1": {"plan": None, "total_us": 1.0}, "8": {"plan": None, "total_us": 1.0}}}
    shipped_m1 = small_m_plan.SHIPPED["fp8_row"][0]
    assert shipped_m1[0] == 1 and shipped_m1[1] is not None
    try:
        small_m_plan.use_tables({})
        builtin = small_m_plan.fp8_plan(1, 4096, 4096, 4096)  # no tables: the built-in tiles
        assert builtin != shipped_m1[1]
        small_m_plan.use_tables(sweep.tables(best))
        # the default won M = 1: the sweep's "default" ran the shipped table's plan, which the table keeps (it
        # once became the built-in plan, and an engine run "with the swept plans" ran slower than shipped)
        assert small_m_plan.fp8_plan(1, 4096, 4096, 4096) == shipped_m1[1]
        # where the shipped table itself says None, the built-in plan stays
        assert small_m_plan.TABLES["fp8_row_w8a8"] == ((1, small_m_plan.SHIPPED["fp8_row_w8a8"][0][1]), (8, None))
        assert small_m_plan.fp8_plan(9, 4096, 4096, 4096) == dot
        assert small_m_plan.fp8_plan(17, 4096, 4096, 4096).split_k == 1  # past the last bucket: built-in
        assert small_m_plan.int4_plan(1, 4096, 4096, 128).kernel == "gemv"
        assert small_m_plan.int4_plan(1, 4096, 4096, 64).kernel == "dot"  # BLOCK_K 128 does not fit group 64
    finally:
        small_m_plan.use_shipped()
    assert small_m_plan.TABLES == small_m_plan.SHIPPED  # restored: the measured tables
    assert small_m_plan.LAYER_PLANS == small_m_plan.SHIPPED_LAYERS


def test_tables_print_as_the_source_small_m_plan_holds(sweep):
    text = sweep.tables_literal({"fp8_row": ((1, SmallMPlan("gemv", 1, 8, 512, 2)), (64, None))})
    assert text.startswith("TABLES: dict[") and text.endswith("}")
    assert "    'fp8_row': (\n        (1, SmallMPlan(kernel='gemv', block_m=1, block_n=8, block_k=512, split_k=2," in text
    assert "        (64, None),\n    )," in text


def test_swept_plans_are_taken_from_either_result_file(sweep):
    from keel_quantization import small_m_plan

    dot = SmallMPlan("dot", 16, 64, 128, 4)
    best = {"fp8_row": {"16": {"plan": dataclasses.asdict(dot), "best": "dot 16x64x128 s4"}}}
    try:
        for result in ({"best_per_bucket": best}, {"cases": {"small-m": {"best_per_bucket": best}}}):
            small_m_plan.use_shipped()
            assert sweep.use_swept_plans(result) == {"fp8_row": {"16": "dot 16x64x128 s4"}}
            assert small_m_plan.fp8_plan(9, 4096, 4096, 4096) == dot
            assert small_m_plan.TABLES["int4"] == small_m_plan.SHIPPED["int4"]  # families not swept keep theirs
            assert small_m_plan.LAYER_PLANS == small_m_plan.SHIPPED_LAYERS  # ... and their per-layer plans
    finally:
        small_m_plan.use_shipped()


def test_a_layer_whose_own_plan_wins_by_the_margin_gets_it(sweep):
    """best_per_bucket names, per bucket, the layers whose own best beat the bucket's plan on them by
    LAYER_MARGIN; layer_plans keys them by (table family, N, K, bucket) for the buckets the tables keep, and
    use_swept_plans replaces the swept family's shipped per-layer plans with them."""
    from keel_quantization import small_m_plan

    a, b, c = "gemv_fold 1x16x1024 w4 s1", "gemv_fold 1x32x1024 w8 s4", "gemv_fold 1x32x1024 w8 s2"
    row = {"family": "int4_g128", "m": 1, "floor_us": 1.0, "bf16_cublas_us": 3.0}
    rows = [{**row, "layer": "o", "n": 4096, "k": 4096, "us": {"default": 9.0, a: 8.0, b: 10.0, c: 9.0}},
            {**row, "layer": "qkv", "n": 6144, "k": 4096, "us": {"default": 9.0, a: 8.0, b: 9.0, c: 7.9}},
            {**row, "layer": "down", "n": 4096, "k": 14336, "us": {"default": 30.0, a: 20.0, b: 18.5, c: 20.5}}]
    best = sweep.best_per_bucket(rows)
    bucket = best["int4_g128"]["1"]
    assert bucket["best"] == a and set(bucket["layers"]) == {"down"}  # qkv's 7.9 is within 3% of 8.0
    assert bucket["layers"]["down"]["best"] == b and bucket["with_layers_total_us"] == 8.0 + 8.0 + 18.5
    plan = sweep.candidates("int4_g128", 1)[b]
    assert sweep.layer_plans(best) == {("int4", 4096, 14336, 1): plan}
    try:
        sweep.use_swept_plans({"best_per_bucket": best})
        assert small_m_plan.LAYER_PLANS == {("int4", 4096, 14336, 1): plan}  # int4 swept: the shipped ones go
        assert small_m_plan.int4_plan(1, 4096, 14336, 128) == plan
        assert small_m_plan.int4_plan(1, 4096, 4096, 128) == sweep.candidates("int4_g128", 1)[a]
    finally:
        small_m_plan.use_shipped()
    text = sweep.tables_literal(sweep.tables(best), sweep.layer_plans(best))
    assert "LAYER_PLANS: LayerPlans = {\n    ('int4', 4096, 14336, 1): SmallMPlan(kernel='gemv_fold'," in text


def test_shipped_layer_plans_override_their_bucket_for_their_shape_only():
    """A per-layer plan serves its (N, K) in its bucket, as measured (no FOLD_MAX_K_PER_SPLIT re-split);
    other shapes and buckets take the table's row; a plan whose K tiles do not fit the groups is passed
    over; use_tables without layers drops them."""
    from keel_quantization import small_m_plan

    assert small_m_plan.LAYER_PLANS == small_m_plan.SHIPPED_LAYERS
    for (family, n, k, max_m), plan in small_m_plan.SHIPPED_LAYERS.items():
        assert family == "int4" and any(m == max_m for m, _ in small_m_plan.SHIPPED[family])
        assert small_m_plan.int4_plan(max_m, n, k, 128) == plan
    down = small_m_plan.SHIPPED_LAYERS[("int4", 4096, 14336, 1)]
    assert down.split_k == 4  # FOLD_MAX_K_PER_SPLIT would have made the row's plan split 2 here
    row = small_m_plan.int4_plan(1, 4096, 4096, 128)
    assert row == small_m_plan.SHIPPED["int4"][0][1] and row != down
    assert small_m_plan.int4_plan(1, 4096, 14336, 0).kernel == "dot"  # gathered groups: gemv_fold never serves
    try:
        small_m_plan.use_tables(small_m_plan.SHIPPED)
        assert small_m_plan.int4_plan(1, 4096, 14336, 128).split_k == 2  # the row's plan, re-split
    finally:
        small_m_plan.use_shipped()
